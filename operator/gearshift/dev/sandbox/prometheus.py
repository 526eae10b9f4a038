"""The sandbox's Prometheus: pod discovery through the API server, the scrape configuration (pure), and
the command line of Debian's ``prometheus``.

Debian's Prometheus (2.42, bookworm) is built without ``kubernetes_sd_configs`` (``promtool check config``
rejects the field), so discovery is bridged: ``gearshift.dev.sandbox.promsd`` lists and watches every pod
through the API server and writes a ``file_sd`` target file whose targets carry exactly the labels
Prometheus' own Kubernetes pod discovery would (``__meta_kubernetes_pod_*``, one target per container
port, see ``pod_targets``). The relabelling is then the standard ``kubernetes-pods`` job of Prometheus'
example configuration (``documentation/examples/prometheus-kubernetes.yml``): a pod is scraped when it is
annotated ``prometheus.io/scrape: "true"``, on ``prometheus.io/port`` (else its declared container ports)
and ``prometheus.io/path`` (else ``/metrics``), at its pod IP — a loopback address in the sandbox. Targets
carry ``namespace``, ``pod``, ``node``, ``container`` and every pod label (``gearshift.io/role`` becomes
``gearshift_io_role``). Prometheus re-reads the file as soon as it changes (inotify).

A second job, ``gearshift-local``, scrapes processes that run on this machine outside the pod runner (the
demo's local ``gearshift operator``): each writes a ``file_sd`` file of its own into the local targets
directory (``local_target``) and removes it when it stops.

The scrape interval is 2 s: the gear controller samples its signals every 2 s (docs/sources.md#shift-signals).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Scrape and evaluation interval, s (docs/sources.md#shift-signals: the gear loop samples every 2 s).
SCRAPE_INTERVAL_S = 2
#: How long the sandbox keeps samples; a sandbox is for tests and demos.
RETENTION = "1d"
POD_JOB = "kubernetes-pods"
#: The job of local processes' targets (``local_target``), one ``file_sd`` file per process.
LOCAL_JOB = "gearshift-local"


def prometheus_config(
    targets_file: Path, scrape_interval_s: int = SCRAPE_INTERVAL_S, local_targets_dir: Path | None = None
) -> dict[str, Any]:
    """The Prometheus configuration (as a YAML-able dict) that scrapes annotated sandbox pods.

    Args:
        targets_file: the ``file_sd`` file ``promsd`` keeps up to date (``pod_targets``).
        scrape_interval_s: scrape interval, s; the timeout is the same (Prometheus requires ≤ interval).
        local_targets_dir: where local processes put their ``*.json`` target files (``local_target``),
            scraped by the ``gearshift-local`` job; None: no such job.
    """
    interval = f"{scrape_interval_s}s"
    meta = "__meta_kubernetes_pod_"
    local = []
    if local_targets_dir is not None:
        # Prometheus watches the directory: a file written or removed takes effect within a second.
        local = [
            {
                "job_name": LOCAL_JOB,
                "file_sd_configs": [
                    {"files": [str(local_targets_dir / "*.json")], "refresh_interval": "30s"}
                ],
            }
        ]
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [
            {
                "job_name": POD_JOB,
                # The file changes within ~0.2 s of a pod change; the refresh is only a safety net.
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "30s"}],
                "relabel_configs": [
                    {
                        "source_labels": [meta + "annotation_prometheus_io_scrape"],
                        "action": "keep",
                        "regex": "true",
                    },
                    # Only running pods have a process behind their IP; Pending/Succeeded ones would
                    # show up as failed targets.
                    {"source_labels": [meta + "phase"], "action": "keep", "regex": "Running"},
                    {
                        "source_labels": [meta + "annotation_prometheus_io_path"],
                        "action": "replace",
                        "regex": "(.+)",
                        "target_label": "__metrics_path__",
                    },
                    {
                        "source_labels": [meta + "ip", meta + "annotation_prometheus_io_port"],
                        "action": "replace",
                        "regex": "(.+);([0-9]+)",
                        "replacement": "$1:$2",
                        "target_label": "__address__",
                    },
                    {"action": "labelmap", "regex": meta + "label_(.+)"},
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": [meta + "name"], "target_label": "pod"},
                    {"source_labels": [meta + "node_name"], "target_label": "node"},
                    {"source_labels": [meta + "container_name"], "target_label": "container"},
                ],
            },
            *local,
        ],
    }


def local_target(address: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The ``file_sd`` content for one local process serving ``/metrics`` at ``address`` (``host:port``),
    its series labelled with ``labels`` (e.g. the ``namespace`` and ``app_kubernetes_io_component`` its pod
    would carry after the pod job's relabelling, so queries read the same either way).

    Raises:
        ValueError: ``address`` is not ``host:port``.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a scrape address is host:port, not {address!r}")
    return [{"targets": [address], "labels": dict(labels)}]


def prometheus_argv(binary: str, config: Path, data_dir: Path, port: int) -> list[str]:
    """The command line of the sandbox's Prometheus, listening on ``127.0.0.1:<port>`` only."""
    return [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        f"--storage.tsdb.retention.time={RETENTION}",
        f"--web.listen-address=127.0.0.1:{port}",
        # /-/reload lets `sandbox up` apply a changed config without a restart.
        "--web.enable-lifecycle",
    ]


def label_name(name: str) -> str:
    """A Kubernetes label/annotation key as Prometheus discovery spells it: every non-[a-zA-Z0-9_] → _
    (``app.kubernetes.io/component`` → ``app_kubernetes_io_component``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``file_sd`` target groups for ``pods`` (API dicts), labelled as Prometheus' Kubernetes pod discovery
    labels them (``discovery/kubernetes/pod.go``): one target per declared container port
    (``<podIP>:<port>``), one per container without ports (``<podIP>``); pods without an IP are skipped.

    Returns ``[{"targets": [address], "labels": {"__meta_kubernetes_...": value}}]``.
    """
    groups = []
    for pod in pods:
        meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
        ip = status.get("podIP")
        if not ip:
            continue
        m = "__meta_kubernetes_pod_"
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        base = {
            "__meta_kubernetes_namespace": meta.get("namespace", ""),
            m + "name": meta.get("name", ""),
            m + "ip": ip,
            m + "uid": meta.get("uid", ""),
            m + "node_name": spec.get("nodeName", ""),
            m + "host_ip": status.get("hostIP", ""),
            m + "phase": status.get("phase", ""),
            m + "ready": "true" if ready else "false",
        }
        owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
        if owners:
            base[m + "controller_kind"] = owners[0].get("kind", "")
            base[m + "controller_name"] = owners[0].get("name", "")
        for key, value in (meta.get("labels") or {}).items():
            base[m + "label_" + label_name(key)] = value
            base[m + "labelpresent_" + label_name(key)] = "true"
        for key, value in (meta.get("annotations") or {}).items():
            base[m + "annotation_" + label_name(key)] = value
            base[m + "annotationpresent_" + label_name(key)] = "true"
        for c in spec.get("containers") or []:
            cl = {**base, m + "container_name": c.get("name", ""), m + "container_image": c.get("image", "")}
            cl[m + "container_init"] = "false"
            ports = c.get("ports") or []
            if not ports:
                groups.append({"targets": [ip], "labels": cl})
            for p in ports:
                labels = {
                    **cl,
                    m + "container_port_name": p.get("name", ""),
                    m + "container_port_number": str(p.get("containerPort", "")),
                    m + "container_port_protocol": p.get("protocol", "TCP"),
                }
                groups.append({"targets": [f"{ip}:{p.get('containerPort')}"], "labels": labels})
    return groups
