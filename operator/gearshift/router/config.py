"""The knobs of the router's request path (``--max-inflight``, ``--headroom-wait-s``, ...): one
:class:`ProxyConfig` read by admission and placement (:mod:`gearshift.router.placement`) and by forwarding
(:mod:`gearshift.router.proxy`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProxyConfig:
    """Limits and knobs of the request path."""

    max_inflight: int = 512
    max_queue: int = 1024
    queue_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 2.0
    retries: int = 2
    kv_bytes_per_token: float = 0.0
    prefill_ms_per_token: float = 0.0
    """Prefill ms per prompt token on the reference card (speed 1); 0 → unknown (pd-score's seed queue)."""
    headroom_wait_s: float = 30.0
    """How long a request no decode pod has KV headroom for is held while placement is retried, s; 0 →
    refused at once (503). Longer than the admission ``queue_timeout_s`` because it must cover what frees
    headroom: requests finishing (a decode of a few hundred tokens takes seconds) or a scale-up's new pod
    (on the sandbox ~10 s from the first miss to the router picking it; real engines take minutes to load
    weights, so there the hold covers transient exhaustion; a sustained one still ends in 503s)."""
    headroom_poll_s: float = 0.05
    """Period of the held head request's placement retries, s (signals change every scrape, 0.5-2 s)."""
    default_max_tokens: int = 16
    text_tokens: str = "chars"
    """How text prompts are counted: ``chars`` (÷4, real tokenizers) or ``words`` (gearshift-sim)."""
    kv_lease_s: float = 0.0
    """How long prefill pods hold a finished request's KV for its decode pod (PDService ``kvLeaseS``,
    vLLM's ``kv_lease_duration``), s; 0: unknown, no hand-off bound
    (:data:`gearshift.router.proxy.KV_HANDOFF_SHARE`)."""
    service: str = ""
    """The PDService whose arrivals ``gearshift_router_arrivals`` counts (``--service``; empty with
    ``--backend``)."""
    roles: tuple[str, ...] = ("prefill", "decode")
    """The roles whose pods serve each request (``--roles``): each arrival is counted once per role."""
