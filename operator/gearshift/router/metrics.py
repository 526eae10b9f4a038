"""The router's own Prometheus metrics (``/metrics``), in a registry of their own."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gearshift.control.signals import LABEL_ROLE, LABEL_SERVICE

#: Latency buckets, s: sub-millisecond router overheads up to multi-second prefill queues.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
#: Inter-token latency buckets, s (vLLM's ITL buckets start at 10 ms).
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# vLLM's own buckets (vllm/v1/metrics/buckets.py, 0.32), so a dashboard's quantiles read alike on the
# router's client-facing series and on an engine's.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)  # fmt: skip
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
#: vLLM's 1-2-5 token-count buckets (``build_1_2_5_buckets``), up to a million tokens: the router does not
#: know each pod's ``max_model_len``, which vLLM stops them at.
VLLM_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))


def observe_many(child: Histogram, amount: float, n: int) -> None:
    """``n`` observations of ``amount`` in a labelled histogram ``child``, for the cost of one: the ITLs of
    ``n`` token events read in one chunk share one gap, and each ``observe`` takes the lock and walks the
    buckets. Reads the child's ``_sum``, ``_buckets`` and ``_upper_bounds``, which ``Histogram.observe``
    updates (prometheus_client 0.20-0.26); tests/unit/test_router_metrics.py holds it equal to ``n``
    ``observe`` calls, so a change there fails a test, not a dashboard."""
    if n <= 1 or amount != amount:  # NaN falls in no bucket of observe(): leave it to observe
        for _ in range(n):
            child.observe(amount)
        return
    child._raise_if_not_observable()
    child._sum.inc(amount * n)
    child._buckets[bisect.bisect_left(child._upper_bounds, amount)].inc(n)


@dataclass
class ClientMetrics:
    """What clients saw, under vLLM's metric names and label (``model_name``), exported by the router.

    Under PD every request is counted by a prefill pod *and* a decode pod, and neither sees the client's
    TTFT; these series count each client request once, timed on the router's side of the client's
    connection (vllm/v1/metrics/loggers.py defines the names; benchmark tools' server-side views and vLLM
    dashboards read them). Select them with the router pod's component label: ``app.kubernetes.io/component``
    is ``router``, ``app_kubernetes_io_component="router"`` under Prometheus' Kubernetes label mapping.
    """

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    success: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram


def make_client_metrics(reg: CollectorRegistry) -> ClientMetrics:
    """The vLLM-named collectors, in ``reg``."""
    label = ["model_name"]
    return ClientMetrics(
        ttft=Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (client side: streamed requests).",
            label,
            buckets=VLLM_TTFT_BUCKETS,
            registry=reg,
        ),
        itl=Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (client side: gaps between token events).",
            label,
            buckets=VLLM_ITL_BUCKETS,
            registry=reg,
        ),
        tpot=Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            label,
            buckets=VLLM_ITL_BUCKETS,
            registry=reg,
        ),
        e2e=Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            label,
            buckets=VLLM_E2E_BUCKETS,
            registry=reg,
        ),
        success=Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*label, "finished_reason"],
            registry=reg,
        ),
        prompt_tokens=Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=reg
        ),
        generation_tokens=Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", label, registry=reg
        ),
        request_prompt_tokens=Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            label,
            buckets=VLLM_TOKEN_BUCKETS,
            registry=reg,
        ),
        request_generation_tokens=Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            label,
            buckets=VLLM_TOKEN_BUCKETS,
            registry=reg,
        ),
    )


#: ``result`` values of ``gearshift_router_slo_requests_total``.
SLO_MET, SLO_MISSED = "met", "missed"


def slo_met(ttft_s: float, tpot_s: float | None, slo_ttft_ms: float, slo_itl_ms: float) -> bool:
    """Whether one answered request met the PDService's SLO as DistServe's goodput counts it (Zhong et al.,
    OSDI 2024) and ``gearshift.dev.loadgen`` measures it: TTFT ≤ ``slo_ttft_ms`` and TPOT ≤ ``slo_itl_ms``.

    Args:
        ttft_s: time to the first token event, s.
        tpot_s: mean time per output token after the first, s; None for an answer of one token (no TPOT:
            only TTFT is judged, as the load generator does).
        slo_ttft_ms, slo_itl_ms: the SLO (``slo.ttftMs``, ``slo.itlMs``), ms.
    """
    return ttft_s * 1e3 <= slo_ttft_ms and (tpot_s is None or tpot_s * 1e3 <= slo_itl_ms)


@dataclass
class RouterMetrics:
    """The router's collectors; every name starts with ``gearshift_router_``."""

    registry: CollectorRegistry
    requests: Counter
    arrivals: Counter
    picks: Counter
    queue_time: Histogram
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    retries: Counter
    kv_reprefills: Counter
    rejects: Counter
    no_decode_headroom: Counter
    headroom_held: Gauge
    inflight: Gauge
    queued: Gauge
    pods_available: Gauge
    ejections: Counter
    panic: Gauge
    client: ClientMetrics
    slo_requests: Counter


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
        arrivals=Counter(
            "gearshift_router_arrivals",
            "Client requests that arrived, counted before admission (served, queued or refused alike), by "
            "the PDService and the role whose pods serve them (both; or prefill and decode, one each): the "
            "load the operator compares with a gear's capacity, which the engines' own counts miss while "
            "the router holds requests for admission or a batch slot.",
            # the engines' label names for the PDService and role: one selector reads both
            [LABEL_SERVICE, LABEL_ROLE],
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
            "Time from admission to the first output token from the upstream, s (streamed answers: a whole "
            "answer's first token is not seen).",
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
        kv_reprefills=Counter(
            "gearshift_router_kv_reprefills",
            "PD requests a decode pod prefilled itself instead of reading the prefill's KV: its pod did "
            "not answer within the hand-off bound (half the KV lease), or a non-streamed decode leg "
            "handed the KV gave no answer within the lease plus 1 s a requested token.",
            ["pod"],
            registry=reg,
        ),
        rejects=Counter(
            "gearshift_router_rejects", "Requests refused by the router, by reason.", ["reason"], registry=reg
        ),
        no_decode_headroom=Counter(
            "gearshift_router_no_decode_headroom",
            "Requests no decode pod had free KV memory >= 1.2 x their KV cache for "
            "(docs/sources.md#decode-headroom: scale up), "
            "counted once per request at its first miss; the operator's autoscaler reads it as an immediate "
            "scale-up signal.",
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
        client=make_client_metrics(reg),
        slo_requests=Counter(
            "gearshift_router_slo_requests",
            "Streamed client requests answered in full, by model_name and whether they met the PDService's "
            "SLO (result met: TTFT <= slo.ttftMs and TPOT <= slo.itlMs, DistServe's goodput; else missed). "
            "Goodput is the rate of result=met.",
            ["model_name", "result"],
            registry=reg,
        ),
    )
