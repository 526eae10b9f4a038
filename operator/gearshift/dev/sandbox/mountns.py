"""Start one sandbox container in a private mount namespace: make its volume mounts, then exec it.

The pod runner starts a container that has ``volumeMounts`` as
``unshare --mount --propagation private -- python -m gearshift.dev.sandbox.mountns PLAN.json -- ARGV...``.
Inside the new namespace (root only; util-linux ``unshare``), this makes each mount of the plan
(``podspec.mount_plan``: bind mounts of per-pod or hostPath directories, tmpfs for ``emptyDir`` with
``medium: Memory``), bind-mounts the sandbox's cluster-DNS hosts file over ``/etc/hosts`` when the plan
names one (``"hosts"``), and execs ARGV with the environment it was given: the same process id, so the
runner's process-group signals reach the container's own program. Nothing outside the namespace changes
except the empty mount-point directories ``mkdir -p`` creates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def _mount(args: list[str]) -> None:
    subprocess.run(["mount", *args], check=True)


def apply(plan: dict[str, Any]) -> None:
    """Make the mounts of ``plan`` (``{"mounts": [...], "hosts": path | None}``) in this namespace.

    Raises:
        subprocess.CalledProcessError: a mount failed (the container then fails to start, with the
            mount's own message in its log).
    """
    for m in plan.get("mounts", []):
        target = Path(m["target"])
        target.mkdir(parents=True, exist_ok=True)
        if m["kind"] == "tmpfs":
            opts = "mode=1777" + (f",size={m['sizeBytes']}" if m.get("sizeBytes") else "")
            _mount(["-t", "tmpfs", "-o", opts, "tmpfs", str(target)])
        else:
            Path(m["source"]).mkdir(parents=True, exist_ok=True)
            _mount(["--bind", m["source"], str(target)])
            if m.get("readOnly"):
                _mount(["-o", "remount,bind,ro", str(target)])
    hosts = plan.get("hosts")
    if hosts:
        _mount(["--bind", hosts, "/etc/hosts"])


def main(argv: list[str] | None = None) -> int:
    """``python -m gearshift.dev.sandbox.mountns PLAN.json -- PROGRAM ARGS...``; returns only on error."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print(
            "usage: python -m gearshift.dev.sandbox.mountns PLAN.json -- PROGRAM [ARGS...]", file=sys.stderr
        )
        return 2
    plan = json.loads(Path(args[0]).read_text())
    apply(plan)
    program = args[2:]
    os.execve(program[0], program, dict(os.environ))
    return 127  # pragma: no cover - execve does not return


if __name__ == "__main__":
    sys.exit(main())
