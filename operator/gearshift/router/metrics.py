"""The router's own Prometheus metrics (``/metrics``), in a registry of their own."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Latency buckets, s: sub-millisecond router overheads up to multi-second prefill queues.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
#: Inter-token latency buckets, s (vLLM's ITL buckets start at 10 ms).
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


@dataclass
class RouterMetrics:
    """The router's collectors; every name starts with ``gearshift_router_``."""

    registry: CollectorRegistry
    requests: Counter
    picks: Counter
    queue_time: Histogram
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    retries: Counter
    rejects: Counter
    no_decode_headroom: Counter
    headroom_held: Gauge
    inflight: Gauge
    queued: Gauge
    pods_available: Gauge
    ejections: Counter
    panic: Gauge


def make_metrics() -> RouterMetrics:
    """Create the collectors in a fresh registry."""
    reg = CollectorRegistry()
    return RouterMetrics(
        registry=reg,
        requests=Counter(
            "gearshift_router_requests",
            "Client requests by policy, chosen prefill and decode pod, and outcome "
            "(ok, client_error, upstream_error, timeout, rejected, no_pod, client_disconnected, cancelled).",
            ["policy", "prefill_pod", "decode_pod", "outcome"],
            registry=reg,
        ),
        picks=Counter(
            "gearshift_router_picks",
            "Pod choices by policy, role and pod.",
            ["policy", "role", "pod"],
            registry=reg,
        ),
        queue_time=Histogram(
            "gearshift_router_queue_seconds",
            "Time a request waited for admission, s.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        ttft=Histogram(
            "gearshift_router_upstream_ttft_seconds",
            "Time from admission to the first output token from the upstream, s.",
            ["policy"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        itl=Histogram(
            "gearshift_router_upstream_itl_seconds",
            "Inter-token latency seen on upstream streams, s.",
            ["policy"],
            buckets=ITL_BUCKETS,
            registry=reg,
        ),
        e2e=Histogram(
            "gearshift_router_e2e_seconds",
            "Request time in the router, s.",
            ["policy"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        retries=Counter(
            "gearshift_router_retries",
            "Requests re-sent to another pod after a failed connect.",
            ["role", "pod"],
            registry=reg,
        ),
        rejects=Counter(
            "gearshift_router_rejects", "Requests refused by the router, by reason.", ["reason"], registry=reg
        ),
        no_decode_headroom=Counter(
            "gearshift_router_no_decode_headroom",
            "Requests no decode pod had free KV memory >= 1.2 x their KV cache for (seed 000: scale up), "
            "counted once per request at its first miss; the operator's autoscaler reads it as an immediate "
            "scale-up signal (issue 12).",
            registry=reg,
        ),
        headroom_held=Gauge(
            "gearshift_router_headroom_held",
            "Requests held (not yet placed) because no decode pod has KV headroom for them.",
            registry=reg,
        ),
        inflight=Gauge("gearshift_router_inflight", "Requests admitted and not finished.", registry=reg),
        queued=Gauge("gearshift_router_queued", "Requests waiting for admission.", registry=reg),
        pods_available=Gauge(
            "gearshift_router_pods_available", "Healthy, non-ejected pods per role.", ["role"], registry=reg
        ),
        ejections=Counter(
            "gearshift_router_ejections",
            "Pods ejected by outlier detection (consecutive errors), by role and pod.",
            ["role", "pod"],
            registry=reg,
        ),
        panic=Gauge(
            "gearshift_router_panic",
            "1 while a role is below the panic threshold and every pod of it is routed to, health ignored.",
            ["role"],
            registry=reg,
        ),
    )
