"""The ``gearshift-router`` flags and what they set: :class:`RouterSettings` from the command line
(:func:`add_arguments`, :func:`settings_from_args`), with the model figures the cost-aware policies read
(:func:`load_model_arch`, :func:`kv_bytes_per_token`, :func:`prefill_ms_per_token`) and the outlier
detection's (:func:`outlier_config`). The process itself is :mod:`gearshift.router.server`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gearshift.control.adaptive_batch import pd_balance
from gearshift.facts.errors import PolicyError, SettingsError
from gearshift.facts.model import load_hf_config
from gearshift.router import policies as P
from gearshift.router.config import ProxyConfig
from gearshift.router.membership import parse_backend
from gearshift.router.outlier import OutlierConfig, OutlierConfigError
from gearshift.router.pool import BackendInfo, PolicyConfig

#: ``--roles``: the role Services a ``--service`` router watches (``gearshift.io/role`` values).
ROLE_SETS: dict[str, tuple[str, ...]] = {"pd": ("prefill", "decode"), "both": ("both",)}


@dataclass
class RouterSettings:
    """Everything a router process is configured with (flags, or the PDService via env)."""

    backends: list[BackendInfo] = field(default_factory=list)
    service: str | None = None
    roles: tuple[str, ...] = ROLE_SETS["pd"]
    """The role Services ``--service`` watches: prefill and decode, or both (an aggregated PDService)."""
    namespace: str = "default"
    kubeconfig: str | None = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    served_model_name: str | None = None
    prometheus_url: str | None = None
    scrape_interval_s: float = 0.5
    health_interval_s: float = 2.0
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    balance_interval_s: float = pd_balance.INTERVAL_S
    apply_rebalance: bool = True
    """The PD guide's rebalancing applied (docs/sources.md#rebalancing): new requests spare the pods a round
    names (``--no-apply-rebalance``
    turns it off)."""
    seed: int | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The router's flags (``gearshift-router`` and ``gearshift router``); env defaults in brackets."""
    env = os.environ.get
    p.add_argument(
        "--host", default=env("GEARSHIFT_HOST", "127.0.0.1"), help="listen address [GEARSHIFT_HOST]"
    )
    p.add_argument("--port", type=int, default=int(env("GEARSHIFT_PORT", "8000")), help="[GEARSHIFT_PORT]")
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="ROLE=URL[;k=v...]",
        help="a static pod (repeat); keys gpu, gpus, node, nic, compute, hbm, speed, maxbatch, ...",
    )
    p.add_argument(
        "--service",
        default=env("GEARSHIFT_SERVICE"),
        help="PDService name: watch the EndpointSlices of its role Services, <svc>-prefill and <svc>-decode "
        "(or <svc>-both, --roles both) [GEARSHIFT_SERVICE]",
    )
    p.add_argument(
        "--roles",
        default=env("GEARSHIFT_ROUTER_ROLES", "pd"),
        choices=sorted(ROLE_SETS),
        help="with --service: pd (prefill and decode pods, the two-leg PD protocol) or both (an aggregated "
        "PDService: whole requests to its serving pods) [GEARSHIFT_ROUTER_ROLES]",
    )
    p.add_argument("--namespace", default=env("GEARSHIFT_NAMESPACE", env("POD_NAMESPACE", "default")))
    p.add_argument("--kubeconfig", default=env("KUBECONFIG"))
    p.add_argument("--policy", default=env("GEARSHIFT_ROUTER_POLICY", P.DEFAULT_POLICY), choices=P.POLICIES)
    p.add_argument(
        "--weights",
        default=env("GEARSHIFT_ROUTER_WEIGHTS"),
        help='JSON {"prefill": {"compute": 0.3, ...}, "decode": {"itl": 0.35}} [GEARSHIFT_ROUTER_WEIGHTS]',
    )
    p.add_argument(
        "--speed-one", action="store_true", help="FastChat's speed 1 for shortest-queue and lottery"
    )
    p.add_argument("--target-itl-ms", type=float, default=P.TARGET_ITL_MS)
    p.add_argument(
        "--target-ttft-ms",
        type=float,
        default=P.TARGET_TTFT_MS,
        help="pd-score: target TTFT, ms, the scale of the prefill queue (expected wait) term",
    )
    p.add_argument(
        "--model",
        default=env("GEARSHIFT_MODEL"),
        help="HF config.json path or ModelArch JSON, for KV bytes per token [GEARSHIFT_MODEL]",
    )
    p.add_argument(
        "--text-tokens",
        choices=["chars", "words"],
        default="chars",
        help="count text prompts as chars/4 (real tokenizers) or words (gearshift-sim)",
    )
    p.add_argument("--served-model-name", default=env("GEARSHIFT_SERVED_MODEL_NAME"))
    p.add_argument(
        "--prometheus", default=env("GEARSHIFT_PROMETHEUS_URL"), help="read signals from Prometheus"
    )
    p.add_argument("--scrape-interval", type=float, default=0.5, help="pod /metrics scrape period, s")
    p.add_argument("--health-interval", type=float, default=2.0, help="pod /health check period, s")
    p.add_argument("--balance-interval", type=float, default=pd_balance.INTERVAL_S, help="s")
    p.add_argument(
        "--apply-rebalance",
        action=argparse.BooleanOptionalAction,
        default=env("GEARSHIFT_APPLY_REBALANCE", "true").lower() not in ("0", "false", "no", "off"),
        help="new requests spare the pods the PD guide's rebalancer names (docs/sources.md#rebalancing), "
        "every --balance-interval (default on; "
        "--no-apply-rebalance only reports them at /debug/decisions) [GEARSHIFT_APPLY_REBALANCE]",
    )
    p.add_argument("--max-inflight", type=int, default=512, help="requests forwarded at once (>= 1)")
    p.add_argument(
        "--max-queue", type=int, default=1024, help="requests waiting for a slot; more are refused"
    )
    p.add_argument("--queue-timeout", type=float, default=10.0, help="s a request may wait for a slot")
    p.add_argument(
        "--headroom-wait",
        type=float,
        default=ProxyConfig.headroom_wait_s,
        help="s a request no decode pod has KV headroom for is held while placement is retried (0: refuse)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="s")
    p.add_argument(
        "--kv-lease-s",
        type=float,
        default=ProxyConfig.kv_lease_s,
        help="s prefill pods hold a request's KV for its decode pod (PDService kvLeaseS); a decode leg goes "
        "to a decode pod that answers within half of it, else without the KV (0: no bound)",
    )
    p.add_argument("--retries", type=int, default=2, help="retries of a leg on another pod")
    # Envoy's outlier detection and active health checking (gearshift.router.outlier); defaults are Envoy's.
    d = OutlierConfig()
    p.add_argument("--health-timeout", type=float, default=d.check_timeout_s, help="s; a slower check fails")
    p.add_argument("--unhealthy-threshold", type=int, default=d.unhealthy_threshold, help="failed checks")
    p.add_argument("--healthy-threshold", type=int, default=d.healthy_threshold, help="passing checks")
    p.add_argument(
        "--consecutive-errors", type=int, default=d.consecutive_errors, help="5xx/connect errors that eject"
    )
    p.add_argument("--base-ejection-time", type=float, default=d.base_ejection_s, help="s, × ejections")
    p.add_argument("--max-ejection-time", type=float, default=d.max_ejection_s, help="s")
    p.add_argument(
        "--max-ejection-percent", type=float, default=d.max_ejection_percent, help="%% of a role at once"
    )
    p.add_argument(
        "--panic-threshold",
        type=float,
        default=d.panic_threshold_percent,
        help="%% available below which all pods are used; 0 disables",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed of lottery and power-of-two")
    p.add_argument("--log-level", default="INFO")


def kv_bytes_per_token(model: str | None) -> float:
    """KV bytes per token of ``--model`` (a config.json path or ModelArch JSON); 0 when not given.

    Raises:
        SettingsError: unreadable or invalid model description.
    """
    arch = load_model_arch(model)
    return float(arch.kv_bytes_per_token) if arch is not None else 0.0


def prefill_ms_per_token(model: str | None) -> float:
    """Prefill time per prompt token of ``--model`` on the reference card (H100 SXM, speed 1), ms; 0 unknown.

    ``num_layers × layer_flops_per_token(0) / (989 TFLOPS × 0.5 MFU)``: the planner's roofline assumptions
    (gearshift.planner.costs.RooflineAssumptions: MFU 0.5, PaLM Table 3) at the datasheet peak
    (gearshift.facts.gpus). Llama-3-8B: ≈ 0.028 ms/token (a 1,155-token prompt ≈ 33 ms; the simulated engine's
    perf model gives 33.3 ms).

    Raises:
        SettingsError: unreadable or invalid model description.
    """
    from gearshift.facts.gpus import GPU_SPECS, REFERENCE_MODEL
    from gearshift.planner.costs import RooflineAssumptions

    arch = load_model_arch(model)
    if arch is None:
        return 0.0
    flops = arch.num_layers * arch.layer_flops_per_token(context=0)
    peak = GPU_SPECS[REFERENCE_MODEL].bf16_tflops * 1e12 * RooflineAssumptions().mfu
    return flops / peak * 1e3


def load_model_arch(model: str | None) -> Any:
    """The :class:`gearshift.facts.model.ModelArch` of ``--model``; None when not given.

    Raises:
        SettingsError: unreadable or invalid model description.
    """
    if not model:
        return None
    from gearshift.facts.model import ModelArch, ModelConfigError, arch_from_hf_config

    try:
        if model.lstrip().startswith("{"):
            doc = json.loads(model)
            arch = ModelArch(**doc) if "num_layers" in doc else arch_from_hf_config(doc)
        else:
            arch = load_hf_config(Path(model))
    except (OSError, ValueError, TypeError, ModelConfigError) as exc:
        raise SettingsError(f"--model {model[:80]!r}: {exc}") from exc
    return arch


def settings_from_args(a: argparse.Namespace) -> RouterSettings:
    """Build :class:`RouterSettings` from parsed flags.

    Raises:
        SettingsError: no pods configured, or bad weights/model; BackendSpecError: a bad --backend.
    """
    if not a.backend and not a.service:
        raise SettingsError("give --backend ROLE=URL (repeat) or --service PDSERVICE (EndpointSlice watch)")
    for flag in (
        "scrape_interval",
        "health_interval",
        "balance_interval",
        "queue_timeout",
        "request_timeout",
    ):
        value = getattr(a, flag)
        if not (math.isfinite(value) and value > 0):
            raise SettingsError(
                f"--{flag.replace('_', '-')} must be a finite number of seconds above 0, got {value}"
            )
    if not (math.isfinite(a.headroom_wait) and a.headroom_wait >= 0):
        raise SettingsError(f"--headroom-wait must be a finite number of seconds >= 0, got {a.headroom_wait}")
    for flag, least in (("max_inflight", 1), ("max_queue", 0), ("retries", 0)):
        if getattr(a, flag) < least:
            raise SettingsError(
                f"--{flag.replace('_', '-')} must be at least {least}, got {getattr(a, flag)}"
            )
    weights: dict[str, Any] = {}
    if a.weights:
        try:
            weights = json.loads(a.weights)
        except ValueError as exc:
            raise SettingsError(f"--weights is not JSON: {exc}") from exc
        if not isinstance(weights, dict) or set(weights) - {"prefill", "decode"}:
            raise SettingsError('--weights must be {"prefill": {...}, "decode": {...}}')
    try:
        policy = PolicyConfig(
            policy=a.policy,
            prefill_weights=weights.get("prefill", {}),
            decode_weights=weights.get("decode", {}),
            target_itl_ms=a.target_itl_ms,
            target_ttft_ms=a.target_ttft_ms,
            speed_one=a.speed_one,
        )
    except PolicyError as exc:
        raise SettingsError(str(exc)) from exc
    return RouterSettings(
        backends=[parse_backend(b) for b in a.backend],
        service=a.service,
        roles=ROLE_SETS[a.roles],
        namespace=a.namespace,
        kubeconfig=a.kubeconfig,
        policy=policy,
        proxy=ProxyConfig(
            max_inflight=a.max_inflight,
            max_queue=a.max_queue,
            queue_timeout_s=a.queue_timeout,
            headroom_wait_s=a.headroom_wait,
            request_timeout_s=a.request_timeout,
            retries=a.retries,
            kv_bytes_per_token=kv_bytes_per_token(a.model),
            prefill_ms_per_token=prefill_ms_per_token(a.model),
            text_tokens=a.text_tokens,
            kv_lease_s=a.kv_lease_s,
            service=a.service or "",
            roles=ROLE_SETS[a.roles],
        ),
        served_model_name=a.served_model_name,
        prometheus_url=a.prometheus,
        scrape_interval_s=a.scrape_interval,
        health_interval_s=a.health_interval,
        outlier=outlier_config(a),
        balance_interval_s=a.balance_interval,
        apply_rebalance=a.apply_rebalance,
        seed=a.seed,
    )


def outlier_config(a: argparse.Namespace) -> OutlierConfig:
    """The outlier thresholds of the flags.

    Raises:
        SettingsError: a threshold out of range (the message names it).
    """
    flags = {
        "consecutive_errors": "consecutive-errors",
        "base_ejection_s": "base-ejection-time",
        "max_ejection_s": "max-ejection-time",
        "max_ejection_percent": "max-ejection-percent",
        "panic_threshold_percent": "panic-threshold",
        "unhealthy_threshold": "unhealthy-threshold",
        "healthy_threshold": "healthy-threshold",
        "check_timeout_s": "health-timeout",
    }
    values = {field_name: getattr(a, flag.replace("-", "_")) for field_name, flag in flags.items()}
    try:
        return OutlierConfig(**values)
    except OutlierConfigError as exc:
        raise SettingsError(f"--{flags[exc.field]}: {exc}") from exc
