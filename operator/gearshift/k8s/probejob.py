"""Pure builder of the probe Job that measures one GPU node; returns a plain dict manifest.

The Job runs ``gearshift-probe device`` once on the node:
  - pinned to the node by node affinity on ``metadata.name`` (as the DaemonSet controller pins its pods),
    not ``spec.nodeName``, so the scheduler still checks that the node's GPUs are free;
  - requesting all of the node's GPUs (``nvidia.com/gpu``), so the probe has every card and no engine
    shares them while it measures;
  - tolerating every ``nvidia.com/gpu`` taint plus configured extra tolerations;
  - ``backoffLimit: 0`` and ``restartPolicy: Never``: one attempt per Job; the operator retries with its
    own exponential back-off, so each attempt's failure is seen and reported;
  - ``activeDeadlineSeconds`` bounds a hung probe (or a pod that never schedules), and
    ``ttlSecondsAfterFinished`` lets the TTL controller delete finished Jobs;
  - owner-referenced to the GPUProfile, so deleting the profile deletes its Jobs.

The probe's result is the container's termination message (``/dev/termination-log``, at most 4096 bytes,
Kubernetes' limit); ``FallbackToLogsOnError`` puts the log tail there when the probe dies without
writing it (e.g. OOM-killed), so the operator can report why.

In the sandbox (``sandbox=True``) the pod carries ``gearshift.io/sandbox-run: "true"`` (only the sandbox's
local pod runner executes it) and runs the simulated probe: ``GEARSHIFT_PROBE_SIMULATED=1`` and the
node's ``gearshift.io/*`` datasheet annotations copied into ``GEARSHIFT_NODE_ANNOTATIONS`` (the
downward API cannot expose node annotations; see :mod:`gearshift.probe.simulated`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gearshift.k8s.names import (
    ANNOTATION_PROBE_NODE,
    COMPONENT_PROBE,
    DOMAIN,
    GPU_RESOURCE,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PROBE_NODE,
    LABEL_SANDBOX_RUN,
    MANAGED_BY,
    is_dns_label,
)

DEFAULT_PROBE_IMAGE = "ghcr.io/gearshift/worker:0.1.0"
DEFAULT_NAMESPACE = "gearshift-system"
#: The Job controller copies the Job's name into the ``batch.kubernetes.io/job-name`` label of its pods, so
#: a Job's name must be a valid label value (63 characters), not just an object name.
MAX_JOB_NAME = 63
JOB_NAME_PREFIX = "gsprobe-"
#: ``-<hash8>-<time suffix>``: 8 hex characters of the node name, and the start time in base 36 seconds.
_SUFFIX_LEN = 1 + 8 + 1 + 7
CONTAINER_NAME = "probe"
#: Environment of the simulated probe (gearshift.probe.simulated and gearshift.probe.__main__).
ENV_SIMULATED = "GEARSHIFT_PROBE_SIMULATED"
ENV_ANNOTATIONS = "GEARSHIFT_NODE_ANNOTATIONS"
ENV_GPU_COUNT = "GEARSHIFT_GPU_COUNT"
ENV_NODE_NAME = "GEARSHIFT_NODE_NAME"


class ProbeJobError(ValueError):
    """Arguments that cannot make a probe Job; the message names the argument."""


@dataclass(frozen=True)
class ProbeJobConfig:
    """How the operator's probe Jobs look (see the module docstring); one per operator.

    Attributes:
        namespace: where probe Jobs are created (the operator's namespace).
        image: the worker image with ``gearshift-probe``.
        sandbox: mark pods for the sandbox's pod runner and run the simulated probe.
        active_deadline_s: seconds after which the Job controller kills the probe (covers a pod that
            never schedules and an image that never pulls), s.
        ttl_s: seconds a finished Job is kept before the TTL controller deletes it, s.
        probe_args: extra arguments of ``gearshift-probe device`` (e.g. ``--batches 1,4``).
        tolerations: tolerations besides the ``nvidia.com/gpu`` one.
        service_account: pod service account (None: the namespace's default).
        simulated: run the simulated probe even without ``sandbox`` (None: same as ``sandbox``).
    """

    namespace: str = DEFAULT_NAMESPACE
    image: str = DEFAULT_PROBE_IMAGE
    sandbox: bool = False
    active_deadline_s: int = 600
    ttl_s: int = 3600
    probe_args: tuple[str, ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    service_account: str | None = None
    simulated: bool | None = None

    def __post_init__(self) -> None:
        if not is_dns_label(self.namespace):
            raise ProbeJobError(
                f"probe namespace {self.namespace!r} must be a DNS label (e.g. gearshift-system)"
            )
        if not self.image:
            raise ProbeJobError("probe image must not be empty")
        if self.active_deadline_s < 1:
            raise ProbeJobError(f"probe active deadline must be >= 1 s, got {self.active_deadline_s}")
        if self.ttl_s < 0:
            raise ProbeJobError(f"probe Job TTL must be >= 0 s, got {self.ttl_s}")

    @property
    def runs_simulated(self) -> bool:
        """Whether the Job runs the simulated probe (the sandbox's fake nodes have no GPU)."""
        return self.sandbox if self.simulated is None else self.simulated


def _hash(text: str, n: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def probe_node_label_value(node: str) -> str:
    """The node name as a label value: itself when it fits 63 characters, else a prefix and a hash."""
    if len(node) <= 63:
        return node
    return f"{node[:54].rstrip('-.')}-{_hash(node)}"


def probe_job_name(node: str, started: datetime) -> str:
    """``gsprobe-<node>-<hash8>-<time>``, at most 63 characters and unique per node and start second.

    The node part is truncated to fit; the hash of the full node name keeps truncated names of different
    nodes apart, and the start time (Unix seconds in base 36) keeps successive probes of one node apart
    while old Jobs wait for their TTL.
    """
    room = MAX_JOB_NAME - len(JOB_NAME_PREFIX) - _SUFFIX_LEN
    part = node.lower()[:room].rstrip("-.")
    # Node names may contain dots (DNS subdomains); Job names work with them, but keep to a DNS label.
    part = part.replace(".", "-")
    stamp = _base36(int(started.timestamp()))[-7:]
    return f"{JOB_NAME_PREFIX}{part}-{_hash(node)}-{stamp}"


def probe_labels(node: str) -> dict[str, str]:
    """Labels of a probe Job and its pods; the operator finds a node's probes by them."""
    return {
        LABEL_NAME: "gearshift",
        LABEL_INSTANCE: "gpu-probe",
        LABEL_COMPONENT: COMPONENT_PROBE,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PROBE_NODE: probe_node_label_value(node),
    }


def simulated_annotations(node_annotations: Mapping[str, str]) -> dict[str, str]:
    """The node's ``gearshift.io/*`` annotations, which the simulated probe reads as the datasheet."""
    return {k: v for k, v in sorted(node_annotations.items()) if k.startswith(f"{DOMAIN}/")}


def build_probe_job_spec(
    *,
    node: str,
    gpu_count: int,
    owner: Mapping[str, str],
    job_name: str,
    config: ProbeJobConfig,
    node_annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The probe Job manifest for ``node`` (see the module docstring).

    Args:
        node: the node to measure.
        gpu_count: GPUs to request (the node's ``nvidia.com/gpu`` capacity), >= 1.
        owner: the GPUProfile's ``apiVersion``, ``kind``, ``name`` and ``uid`` (the owner reference).
        job_name: from :func:`probe_job_name`.
        config: the operator's probe settings.
        node_annotations: the node's annotations (used only by the simulated probe).

    Returns:
        A ``batch/v1`` Job as a plain dict (namespace ``config.namespace``).

    Raises:
        ProbeJobError: ``gpu_count`` < 1, an incomplete ``owner``, or a ``job_name`` over 63 characters.
    """
    if gpu_count < 1:
        raise ProbeJobError(f"gpu_count must be >= 1 for node {node}, got {gpu_count}")
    missing = [k for k in ("apiVersion", "kind", "name", "uid") if not owner.get(k)]
    if missing:
        raise ProbeJobError(f"owner lacks {', '.join(missing)}: pass the GPUProfile's identity")
    if len(job_name) > MAX_JOB_NAME:
        raise ProbeJobError(f"job_name {job_name!r} is over {MAX_JOB_NAME} characters")
    labels = probe_labels(node)
    pod_labels = dict(labels)
    if config.sandbox:
        pod_labels[LABEL_SANDBOX_RUN] = "true"
    env: list[dict[str, Any]] = [
        {"name": ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": ENV_GPU_COUNT, "value": str(gpu_count)},
    ]
    if config.runs_simulated:
        env += [
            {"name": ENV_SIMULATED, "value": "1"},
            {
                "name": ENV_ANNOTATIONS,
                "value": json.dumps(simulated_annotations(node_annotations or {}), sort_keys=True),
            },
        ]
    tolerations = [{"key": GPU_RESOURCE, "operator": "Exists"}]
    tolerations += [copy.deepcopy(dict(t)) for t in config.tolerations]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                }
            }
        },
        "tolerations": tolerations,
        # The probe writes its result and exits; nothing to drain.
        "terminationGracePeriodSeconds": 10,
        "containers": [
            {
                "name": CONTAINER_NAME,
                "image": config.image,
                "command": ["gearshift-probe"],
                "args": ["device", *config.probe_args],
                "env": env,
                "resources": {
                    "limits": {GPU_RESOURCE: str(gpu_count)},
                    "requests": {GPU_RESOURCE: str(gpu_count)},
                },
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
    }
    if config.service_account:
        pod_spec["serviceAccountName"] = config.service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name,
            "namespace": config.namespace,
            "labels": labels,
            "annotations": {ANNOTATION_PROBE_NODE: node},
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": owner["name"],
                    "uid": owner["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": config.active_deadline_s,
            "ttlSecondsAfterFinished": config.ttl_s,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def tolerations_from_json(text: str) -> tuple[dict[str, Any], ...]:
    """Parse extra tolerations given as a JSON list (the ``GEARSHIFT_PROBE_TOLERATIONS`` setting).

    Raises:
        ProbeJobError: not JSON, not a list of objects, or an entry without ``key`` or ``operator: Exists``.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProbeJobError(f"probe tolerations are not JSON ({exc.msg}); give a JSON list") from None
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise ProbeJobError('probe tolerations must be a JSON list of objects, e.g. [{"operator": "Exists"}]')
    for i, t in enumerate(data):
        if not t.get("key") and t.get("operator") != "Exists":
            raise ProbeJobError(
                f"probe tolerations[{i}] needs a key, or operator Exists to match every taint"
            )
    return tuple(data)
