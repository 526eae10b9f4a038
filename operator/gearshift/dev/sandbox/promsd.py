"""Pod discovery for the sandbox's Prometheus through the API server, written as a ``file_sd`` file.

Lists and watches every pod (all namespaces) with the sandbox's kubeconfig and rewrites the target file
(``prometheus.pod_targets``) atomically within ``DEBOUNCE_S`` of a change. Prometheus watches the file
with inotify. Run as ``python -m gearshift.dev.sandbox.promsd --kubeconfig K --out FILE`` (``sandbox up``
does).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gearshift.dev.sandbox.prometheus import pod_targets

DEBOUNCE_S = 0.2
WATCH_TIMEOUT_S = 60


def _log(msg: str) -> None:
    print(f"{datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')} {msg}", flush=True)


def write_groups(out: Path, groups: list[dict[str, Any]]) -> None:
    """Write ``file_sd`` target ``groups`` to ``out`` atomically (a rename: Prometheus never reads half a
    file). The temporary name does not end in ``.json``, so a ``*.json`` glob never matches it."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(groups, indent=1, sort_keys=True))
    tmp.replace(out)


def write_targets(out: Path, pods: list[dict[str, Any]]) -> int:
    """Write the target groups of ``pods`` to ``out`` atomically; returns the number of groups."""
    groups = pod_targets(pods)
    write_groups(out, groups)
    return len(groups)


def serve(api: Any, out: Path, stop: threading.Event) -> None:
    """Keep ``out`` in step with the cluster's pods until ``stop`` is set."""
    from kubernetes import client, watch

    core = client.CoreV1Api(api)
    pods: dict[str, dict[str, Any]] = {}
    dirty = threading.Event()
    lock = threading.Lock()

    def writer() -> None:
        while not stop.is_set():
            if dirty.wait(0.5):
                time.sleep(DEBOUNCE_S)
                dirty.clear()
                with lock:
                    snapshot = list(pods.values())
                write_targets(out, snapshot)

    threading.Thread(target=writer, name="writer", daemon=True).start()
    while not stop.is_set():
        try:
            listing = core.list_pod_for_all_namespaces()
            with lock:
                pods.clear()
                for p in listing.items:
                    d = api.sanitize_for_serialization(p)
                    pods[d["metadata"]["uid"]] = d
            dirty.set()
            w = watch.Watch()
            for ev in w.stream(
                core.list_pod_for_all_namespaces,
                resource_version=listing.metadata.resource_version,  # type: ignore[union-attr]  # the API server always sets a list's metadata
                timeout_seconds=WATCH_TIMEOUT_S,
            ):
                if stop.is_set():
                    w.stop()
                    break
                if ev["type"] == "ERROR":
                    break
                d = api.sanitize_for_serialization(ev["object"])
                with lock:
                    if ev["type"] == "DELETED":
                        pods.pop(d["metadata"]["uid"], None)
                    else:
                        pods[d["metadata"]["uid"]] = d
                dirty.set()
        except Exception as exc:  # an API server restart must not end discovery
            if stop.is_set():
                break
            _log(f"watch failed ({type(exc).__name__}: {exc}); retrying in 1 s")
            stop.wait(1.0)


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="gearshift-sandbox-promsd", description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True, help="the sandbox's kubeconfig")
    parser.add_argument("--out", type=Path, required=True, help="file_sd target file to maintain")
    args = parser.parse_args(argv)
    from kubernetes import config as kconfig

    api = kconfig.new_client_from_config(config_file=str(args.kubeconfig))
    # SIGTERM keeps its default action: there is nothing to clean up, and a handler would wait for the
    # blocking watch read to return.
    stop = threading.Event()
    if not args.out.exists():
        write_targets(args.out, [])
    _log(f"discovering pods into {args.out}")
    serve(api, args.out, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
