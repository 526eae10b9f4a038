"""Names, labels and annotations that gearshift writes, and the length limits they imply.

Every object the operator creates is found again by these labels, never by parsing names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from gearshift import GROUP

#: The prefix of every gearshift label, annotation and finalizer (the API group).
DOMAIN = GROUP
#: The extended resource of NVIDIA's device plugin (also advertised by the sandbox's fake nodes).
GPU_RESOURCE = "nvidia.com/gpu"
#: Prefix of the datasheet annotations on each sandbox GPU node, which the simulated probe reads.
ANNOTATION_PREFIX = f"{DOMAIN}/"

# --- labels on objects the operator creates (DESIGN.md) -------------------------------------------
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = f"{DOMAIN}/service"
LABEL_ROLE = f"{DOMAIN}/role"
LABEL_GEAR = f"{DOMAIN}/gear"
LABEL_STAGE = f"{DOMAIN}/stage"
MANAGED_BY = "gearshift"

# --- node labels written from GPUProfiles ---------------------------------------------------------
NODE_GPU_MODEL = f"{DOMAIN}/gpu-model"
NODE_COMPUTE_CLASS = f"{DOMAIN}/compute-class"
NODE_MEMORY_GIB = f"{DOMAIN}/memory-gib"
NODE_PROFILED = f"{DOMAIN}/profiled"

# --- annotations ----------------------------------------------------------------------------------
#: On a node: ask for a new probe now (any value).
ANNOTATION_REPROBE = f"{DOMAIN}/reprobe"
#: On a node: RFC 3339 time after which the node is reclaimed (a "time fragment",
#: docs/sources.md#fragmentation).
ANNOTATION_AVAILABLE_UNTIL = f"{DOMAIN}/available-until"

#: On a head pod: the autoscaler is draining it before a scale-down; the router stops picking it (``"true"``).
LABEL_DRAINING = f"{DOMAIN}/draining"

#: On a head pod of a warming shadow gear: the router mirrors a share of live requests to it (``"true"``);
#: set and cleared on the pods by the shifting loop, never in the pod template (gearshift.k8s.warming).
LABEL_WARMING = f"{DOMAIN}/warming"
#: On a warming head pod: its ``mirror_rps``, the most mirrored requests/s one router replica sends it
#: (gearshift.k8s.warming.mirror_rps, from ``warmupShare``); ``"0"``: none predicted, no mirror. Written by
#: :func:`format_mirror_rps`, read back by :func:`parse_mirror_rps`.
ANNOTATION_MIRROR_RPS = f"{DOMAIN}/mirror-rps"


def format_mirror_rps(mirror_rps: float) -> str:
    """The :data:`ANNOTATION_MIRROR_RPS` value of ``mirror_rps`` (requests/s) to 6 significant digits
    (``"2.4"``, ``"0"``)."""
    return f"{mirror_rps:.6g}"


def parse_mirror_rps(annotations: Mapping[str, str]) -> float:
    """A pod's ``mirror_rps`` (requests/s) from its annotations: :data:`ANNOTATION_MIRROR_RPS` read back;
    0 (no mirror) when it is absent, unreadable, not finite or not positive."""
    try:
        rps = float(annotations.get(ANNOTATION_MIRROR_RPS, "0"))
    except ValueError:
        return 0.0
    return rps if math.isfinite(rps) and rps > 0 else 0.0


#: On a serving (decode) head pod: the most requests one router replica keeps on it at once, the operator's
#: adaptive max batch (``status.adaptiveBatch.effective`` of its GearSet / router replicas, at least 1;
#: gearshift.control.adaptive_batch.tick). Absent: no router-side cap (the engine's own max batch applies).
ANNOTATION_MAX_BATCH = f"{DOMAIN}/max-batch"
#: On a GearSet: ``"off"`` (or ``"false"``) keeps the operator's adaptive max batch off (the pods' caps are
#: removed); ``"on"``/``"true"`` or absent: on; any other value is ignored with a warning.
ANNOTATION_ADAPTIVE_BATCH = f"{DOMAIN}/adaptive-batch"

#: On a pod: run its container as a local process in the sandbox (the local pod runner).
LABEL_SANDBOX_RUN = f"{DOMAIN}/sandbox-run"

#: On a probe Job and its pods: the node measured (a label value; see ``probe_node_label_value``).
LABEL_PROBE_NODE = f"{DOMAIN}/probe-node"
#: On a probe Job: the full node name (node names may exceed a label value's 63 characters).
ANNOTATION_PROBE_NODE = f"{DOMAIN}/probe-node"

#: Component values.
COMPONENT_ENGINE = "engine"
COMPONENT_ROUTER = "router"
COMPONENT_PROBE = "probe"

#: The roles of a disaggregated PDService; an aggregated one has the one role ``both`` (the service's own
#: list is ``gearshift.api.pdservice.PDServiceSpec.roles``).
ROLES = ("prefill", "decode")

#: A StatefulSet's name must leave room for the ``controller-revision-hash`` label value
#: ``<name>-<10-char hash>`` within the 63-character label limit, hence 52.
MAX_STATEFULSET_NAME = 52
#: The longest role name plus the gear and stage parts: ``-prefill-<gear>-s<kk>``.
MAX_GEAR_NAME = 20
MAX_SERVICE_NAME = MAX_STATEFULSET_NAME - len("-prefill-") - MAX_GEAR_NAME - len("-s99")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def is_dns_label(value: str, max_len: int = 63) -> bool:
    """True when ``value`` is an RFC 1123 label of at most ``max_len`` characters."""
    return len(value) <= max_len and bool(_DNS_LABEL.match(value))


def stage_statefulset_name(service: str, role: str, gear: str, stage: int) -> str:
    """``<pds>-<role>-<gear>-s<k>``: the StatefulSet of one stage of one gear (DESIGN.md)."""
    return f"{service}-{role}-{gear}-s{stage}"


def gear_headless_service_name(service: str, role: str, gear: str) -> str:
    """``<pds>-<role>-<gear>``: the headless Service giving a gear's pods stable DNS names."""
    return f"{service}-{role}-{gear}"


def role_service_name(service: str, role: str) -> str:
    """``<pds>-<role>``: the Service whose selector names the role's *active* gear."""
    return f"{service}-{role}"


def router_name(service: str) -> str:
    """``<pds>-router``: the router Deployment."""
    return f"{service}-router"


def common_labels(service: str, component: str) -> dict[str, str]:
    """Labels every object of one PDService carries."""
    return {
        LABEL_NAME: "gearshift",
        LABEL_INSTANCE: service,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_SERVICE: service,
    }


def engine_labels(service: str, role: str, gear: str, stage: int | None = None) -> dict[str, str]:
    """Labels of an engine pod (or the selector of a gear/stage when ``stage`` is given)."""
    labels = common_labels(service, COMPONENT_ENGINE) | {LABEL_ROLE: role, LABEL_GEAR: gear}
    if stage is not None:
        labels[LABEL_STAGE] = str(stage)
    return labels
