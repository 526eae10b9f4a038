"""The operator's own Prometheus metrics (served by ``gearshift operator --metrics-port``).

Names follow the Prometheus naming guide (``_total`` counters, ``_seconds`` histograms, base units).
The shift counters and the decision-latency histogram are filled by the gear-shifting loop.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "gearshift_operator_reconciles_total",
    "Reconciles run, by kind and result (ok, invalid, waiting, error).",
    ["kind", "result"],
)
ERRORS = Counter(
    "gearshift_operator_errors_total",
    "Reconcile errors, by kind and error class.",
    ["kind", "error"],
)
RECONCILE_SECONDS = Histogram(
    "gearshift_operator_reconcile_seconds",
    "Time of one reconcile, s.",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
API_REQUESTS = Counter(
    "gearshift_operator_api_requests_total",
    "Kubernetes API requests the handlers made (kopf's own watches and patches aside), by HTTP verb and "
    "resource (with subresource, e.g. gpuprofiles/status).",
    ["verb", "resource"],
)
APPLIED = Counter(
    "gearshift_operator_applied_objects_total", "Objects server-side applied by reconciles.", ["kind"]
)
#: ``service_namespace``, not ``namespace``: Prometheus' pod job sets ``namespace`` to the operator pod's.
SHIFTS = Counter(
    "gearshift_operator_shifts_total",
    "Gear shifts finished, by the PDService's namespace and name, role and outcome.",
    ["service_namespace", "service", "role", "outcome"],
)
DECISION_SECONDS = Histogram(
    "gearshift_operator_decision_seconds",
    "Time of one gear-shift decision (signals to decision), s.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
#: Per sampling loop (``shifting tick``, ``autoscale tick``, ``adaptive batch tick``): the
#: loop never falls behind silently.
SAMPLES_MISSED = Counter(
    "gearshift_operator_samples_missed_total",
    "Sample instants a GearSet's loop passed without a sample of their own (a turn longer than the "
    "sample interval), by loop.",
    ["loop"],
)
SAMPLE_TO_STATUS_SECONDS = Histogram(
    "gearshift_operator_sample_to_status_seconds",
    "Time from a shifting tick's sample to its GearSet status stored (status.signals.sampleTime to the "
    "write's answer), s.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60),
)
SERVICES = Gauge("gearshift_operator_pdservices", "PDServices known to this operator, by phase.", ["phase"])
LEADER = Gauge(
    "gearshift_operator_leader",
    "1 while this replica holds the leader Lease and handles resources, 0 while it waits as a standby.",
)
#: Carried across the operator's re-exec (``gearshift.handlers.main``), so it counts the losses
#: of the container's life, not of one process image; it starts at 0 when the container (re)starts.
LEADER_LOSSES = Counter(
    "gearshift_operator_leader_losses",
    "Times this replica led and lost the leader Lease (then stopped writing and re-executed itself).",
)
#: Per gear of each GearSet (its PDService's namespace and name, role): what the dashboard's gear panels
#: show. Set by every shifting tick; a deleted GearSet's series go (:func:`forget_gears`).
GEAR_LABELS = ("service_namespace", "service", "role", "gear")
ACTIVE_GEAR = Gauge(
    "gearshift_operator_active_gear",
    "1 for the gear of the role that serves (status.activeGear), 0 for its other gears.",
    GEAR_LABELS,
)
GEAR_GPUS = Gauge(
    "gearshift_operator_gear_gpus",
    "GPUs (nvidia.com/gpu) the pods of the gear ask for now: the serving gear's, and a shadow's or a "
    "draining gear's during a shift.",
    GEAR_LABELS,
)


def record_gears(namespace: str, service: str, role: str, active: str, gpus: Mapping[str, int]) -> None:
    """Set :data:`ACTIVE_GEAR` and :data:`GEAR_GPUS` for every gear in ``gpus`` (gear → GPUs held)."""
    for gear, n in gpus.items():
        ACTIVE_GEAR.labels(namespace, service, role, gear).set(1.0 if gear == active else 0.0)
        GEAR_GPUS.labels(namespace, service, role, gear).set(n)


def forget_gears(namespace: str, service: str, role: str) -> int:
    """Remove every gear series of ``namespace/service``'s ``role``; returns how many went."""
    gone = 0
    for gauge in (ACTIVE_GEAR, GEAR_GPUS):
        for metric in gauge.collect():
            for sample in metric.samples:
                lab = sample.labels
                if (lab["service_namespace"], lab["service"], lab["role"]) == (namespace, service, role):
                    gauge.remove(namespace, service, role, lab["gear"])
                    gone += 1
    return gone
