"""What the pod runner writes to a pod's status, from its records of the pod's containers (pure): the
phase, the container statuses and the conditions, as the kubelet reports them."""

from __future__ import annotations

from typing import Any

from gearshift.dev.sandbox.containers import PodRun


def pod_phase(run: PodRun) -> str:
    """The pod's phase: Pending, Running, Succeeded or Failed."""
    cs = run.containers
    if run.error and run.restart_policy != "Always":
        return "Failed"
    if cs and all(c.done for c in cs):
        return "Succeeded" if all(c.exit_code == 0 for c in cs) else "Failed"
    if any(c.started_at for c in cs):
        return "Running"
    return "Pending"


def pod_status(run: PodRun) -> tuple[dict[str, Any], dict[str, tuple[str, str, str]]]:
    """The pod's ``status`` (phase, container statuses, pod IP, the error that keeps it from running) and
    its conditions' updates (type → status, reason, message), to merge into the ones it has."""
    phase = pod_phase(run)
    statuses = []
    for c in run.containers:
        statuses.append(c.status())
    if run.error:
        reason = "CreateContainerConfigError"
        spec_containers = run.pod.get("spec", {}).get("containers", [])
        statuses = [
            {
                "name": sc["name"],
                "image": sc.get("image", ""),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": run.error}}
                if phase != "Failed"
                else {"terminated": {"exitCode": 128, "reason": reason, "message": run.error}},
            }
            for sc in spec_containers
        ]
    ready = phase == "Running" and bool(run.containers) and all(c.ready for c in run.containers)
    not_ready = [c.name for c in run.containers if not c.ready]
    why = "" if ready else (run.error or f"containers with unready status: [{' '.join(not_ready)}]")
    reason = "" if ready else ("PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady")
    flag = "True" if ready else "False"
    updates = {
        "Initialized": ("True", "", ""),
        "Ready": (flag, reason, why),
        "ContainersReady": (flag, reason, why),
    }
    body: dict[str, Any] = {"phase": phase, "containerStatuses": statuses}
    if run.pod_ip:
        body["podIP"] = run.pod_ip
        body["podIPs"] = [{"ip": run.pod_ip}]
    if run.error:
        body["message"] = run.error
        body["reason"] = "CreateContainerConfigError"
    return body, updates
