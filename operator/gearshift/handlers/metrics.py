"""The operator's own Prometheus metrics (served by ``gearshift operator --metrics-port``).

Names follow the Prometheus naming guide (``_total`` counters, ``_seconds`` histograms, base units).
The shift counters and the decision-latency histogram are filled by the gear-shifting loop (issue 9).
"""

from __future__ import annotations

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
SERVICES = Gauge("gearshift_operator_pdservices", "PDServices known to this operator, by phase.", ["phase"])
LEADER = Gauge(
    "gearshift_operator_leader",
    "1 while this replica holds the leader Lease and handles resources, 0 while it waits as a standby.",
)
