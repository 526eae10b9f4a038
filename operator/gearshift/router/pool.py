"""The router's live pod set: one mutable record per pod (facts, signals, counters, health) and the picker.

Unlike :class:`gearshift.router.policies.PodView`, a :class:`Backend` changes all the time (scrapes, picks,
failures); policies only ever see frozen views of it. Time is passed in (``now``, monotonic seconds).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gearshift.router import outlier
from gearshift.router import policies as P


@dataclass(frozen=True)
class BackendInfo:
    """Static facts of one pod, from membership (EndpointSlice + GPUProfile) or a ``--backend`` flag."""

    name: str
    url: str
    """Base URL, ``http://<pod ip>:<port>`` (loopback in the sandbox)."""
    role: P.Role = "both"
    gpu_model: str | None = None
    gpu_count: int = 1
    tp_size: int = 1
    node: str | None = None
    nic_gbps: float = 100.0
    latency_us: float = 10.0
    compute_score: float | None = None
    hbm_gbps: float | None = None
    speed: float | None = None
    max_batch: int = 256
    max_queue: int = 16
    kv_capacity_bytes: float | None = None
    itl_prior_ms: float | None = None
    batch_cap: int | None = None
    """Most requests this router keeps on the pod at once, when it serves (decode or both): the operator's
    adaptive max batch (pod annotation ``gearshift.io/max-batch``,
    :mod:`gearshift.control.adaptive_batch.tick`). None: no cap here (the engine's own ``max_batch`` queues
    what is beyond it)."""


@dataclass
class Backend:
    """One pod as the router tracks it."""

    info: BackendInfo
    running: float = 0.0
    waiting: float = 0.0
    gpu_util: float = 0.0
    kv_usage: float | None = None
    """KV-cache usage 0..1; None while the pod exports no KV-usage series (unknown is not empty)."""
    kv_capacity_bytes: float | None = None
    itl_ms: float | None = None
    fc_queue: float = 0.0
    """FastChat queue length: overwritten by each scrape, +1 at each pick."""
    inflight: int = 0
    held: int = 0
    """Requests placed on this pod as their serving (decode or both) pod and not finished: counted from
    the pick, before a PD request's prefill leg, so requests still prefilling count against the cap."""
    # Health and ejection state, kept by gearshift.router.outlier (Envoy's semantics).
    healthy: bool = True
    check_failures: int = 0
    check_passes: int = 0
    failures: int = 0
    """Consecutive errors (5xx answers, failed connects) of proxied legs."""
    ejected_until: float = 0.0
    ejections: int = 0
    returned_at: float = 0.0
    last_scrape: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def has_room(self) -> bool:
        """Below its :attr:`BackendInfo.batch_cap` (always, without one)."""
        cap = self.info.batch_cap
        return cap is None or self.held < cap

    def available(self, now: float) -> bool:
        """Healthy by active checks and not ejected (panic mode may still route to it)."""
        return outlier.available(self, now)

    @property
    def kv_capacity(self) -> float | None:
        """KV pool size, bytes: the scraped one, else the pod's declared one; None when neither is known."""
        return self.kv_capacity_bytes if self.kv_capacity_bytes is not None else self.info.kv_capacity_bytes

    def view(self, kv_usage_unknown: float = 0.0) -> P.PodView:
        """The frozen view policies score; ``kv_usage_unknown`` stands in for a KV usage not reported."""
        i = self.info
        return P.PodView(
            name=i.name,
            role=i.role,
            gpu_model=i.gpu_model,
            gpu_count=i.gpu_count,
            tp_size=i.tp_size,
            compute_score=i.compute_score,
            hbm_gbps=i.hbm_gbps,
            speed=i.speed,
            node=i.node,
            nic_gbps=i.nic_gbps,
            latency_us=i.latency_us,
            running=self.running,
            waiting=self.waiting,
            queue_length=self.fc_queue,
            inflight=self.inflight,
            gpu_util=self.gpu_util,
            kv_usage=self.kv_usage if self.kv_usage is not None else kv_usage_unknown,
            kv_capacity_bytes=self.kv_capacity,
            itl_ms=self.itl_ms,
            itl_prior_ms=i.itl_prior_ms,
            max_batch=i.max_batch,
            max_queue=i.max_queue,
        )


@dataclass
class PolicyConfig:
    """A PDService's ``spec.router`` as the picker uses it."""

    policy: str = P.DEFAULT_POLICY
    prefill_weights: Mapping[str, float] = field(default_factory=lambda: dict(P.PREFILL_WEIGHTS))
    decode_weights: Mapping[str, float] = field(default_factory=lambda: dict(P.DECODE_WEIGHTS))
    target_itl_ms: float = P.TARGET_ITL_MS
    target_ttft_ms: float = P.TARGET_TTFT_MS
    """Scale of pd-score's prefill queue term (expected wait), ms (PDService ``slo.ttftMs``)."""
    speed_one: bool = False
    """FastChat's fixed speed 1 for ``shortest-queue``/``lottery`` (the benchmark baseline)."""

    def __post_init__(self) -> None:
        P.check_policy(self.policy)
        self.prefill_weights = P.check_weights(
            self.prefill_weights, P.PREFILL_WEIGHTS, "router.weights.prefill"
        )
        self.decode_weights = P.check_weights(self.decode_weights, P.DECODE_WEIGHTS, "router.weights.decode")


class Pool:
    """The pods of one PDService by name, and the per-role picking state."""

    def __init__(
        self,
        config: PolicyConfig,
        rng: random.Random | None = None,
        outlier_cfg: outlier.OutlierConfig | None = None,
    ) -> None:
        self.config = config
        self.outlier = outlier_cfg or outlier.OutlierConfig()
        self.panic: dict[str, bool] = {}
        """Per role: whether the last pick ran in panic mode (every pod routable, health ignored)."""
        self.backends: dict[str, Backend] = {}
        self.rng = rng or random.Random()
        self._rr: dict[str, int] = {}
        self.avoid: set[str] = set()
        """Pods the rebalancer asked to spare (used only when other candidates exist)."""

    # --- membership ----------------------------------------------------------------------------
    def set_members(self, infos: Iterable[BackendInfo]) -> None:
        """Replace the pod set; pods that stay keep their signals and counters."""
        new: dict[str, Backend] = {}
        for info in infos:
            old = self.backends.get(info.name)
            if old is not None:
                old.info = info
                new[info.name] = old
            else:
                new[info.name] = Backend(info)
        self.backends = new

    def members(self, role: str) -> list[Backend]:
        """Pods serving ``role`` (``both`` pods serve either), sorted by name."""
        return [b for _, b in sorted(self.backends.items()) if b.info.role == role or b.info.role == "both"]

    def candidates(
        self, role: str, now: float, exclude: Iterable[str] = (), capped: bool = False
    ) -> list[Backend]:
        """Routable pods serving ``role`` (:func:`gearshift.router.outlier.routable`: the available ones,
        or all of them in panic mode), sorted by name, minus ``exclude``; with ``capped``, minus the pods
        at their batch cap. Pods the rebalancer spares are left out while others remain."""
        skip = set(exclude)
        members = self.members(role)
        outlier.release_expired(members, now)
        idx, self.panic[role] = outlier.routable(members, now, self.outlier)
        out = [members[i] for i in idx if members[i].info.name not in skip]
        if capped:
            out = [b for b in out if b.has_room()]
        spared = [b for b in out if b.info.name not in self.avoid]
        return spared or out

    def has_room(self, role: str, now: float) -> bool:
        """Whether a routable pod serving ``role`` is below its batch cap (no pod at all: True, so the
        caller's pick reports the missing pod rather than waiting for one)."""
        return bool(self.candidates(role, now, capped=True)) or not self.candidates(role, now)

    def record_error(self, b: Backend, now: float) -> bool:
        """Count an error of ``b``'s leg; True when that ejected ``b`` (:func:`outlier.record_error`)."""
        role = "decode" if b.info.role == "both" else b.info.role
        return outlier.record_error(b, now, self.members(role), self.outlier)

    def has_role(self, role: str) -> bool:
        return any(b.info.role == role for b in self.backends.values())

    # --- picking ---------------------------------------------------------------------------------
    def pick(
        self,
        role: P.Role,
        request: P.RequestView,
        now: float,
        peer: Backend | None = None,
        exclude: Iterable[str] = (),
    ) -> Backend:
        """Choose one pod of ``role`` by the configured policy and count the pick.

        A serving pick (``decode``, ``both``) skips pods at their batch cap (:meth:`Backend.has_room`).

        Raises:
            NoPodError: no available pod; BatchFullError: every one is at its batch cap;
                NoDecodeCapacityError: pd-score's headroom filter emptied the set.
        """
        cands = self.candidates(role, now, exclude, capped=role != "prefill")
        if not cands:
            if role != "prefill" and self.candidates(role, now, exclude):
                raise P.BatchFullError(role)
            raise P.NoPodError(
                role, "no pod in the set" if not self.members(role) else "every pod was tried already"
            )
        # A pod that exports no KV usage is priced as the fullest pod that does: scoring it as empty sent it
        # every decode request. Among pods that all hide it the value is moot (all equal).
        known = [b.kv_usage for b in cands if b.kv_usage is not None]
        views = [b.view(max(known, default=0.0)) for b in cands]
        cfg = self.config
        policy = cfg.policy
        if policy == "pd-score":
            peer_view = peer.view() if peer is not None else None
            # An aggregated pod (both) holds the whole request's KV and runs its decode steps, so seed
            # 000's decode score applies to it: ITL, free memory for the KV (1.2x headroom), batch fill.
            if role in ("decode", "both"):
                scored = P.score_decode(views, request, peer_view, cfg.decode_weights, cfg.target_itl_ms)
                if not scored:
                    raise P.NoDecodeCapacityError(request.kv_bytes)
            else:
                scored = P.score_prefill(views, request, peer_view, cfg.prefill_weights, cfg.target_ttft_ms)
            chosen_name = P.best(scored).pod.name
            idx = next(i for i, v in enumerate(views) if v.name == chosen_name)
        elif policy == "shortest-queue":
            idx = P.shortest_queue(views, role, cfg.speed_one)
        elif policy == "lottery":
            idx = P.lottery(views, role, self.rng, cfg.speed_one)
        elif policy == "round-robin":
            n = self._rr.get(role, 0)
            idx = P.round_robin(views, role, n)
            self._rr[role] = n + 1
        elif policy == "power-of-two":
            idx = P.power_of_two(views, role, self.rng)
        else:
            idx = P.least_request(views, role)
        chosen = cands[idx]
        chosen.fc_queue += 1
        return chosen

    def with_policy(self, policy: str) -> PolicyConfig:
        """A copy of the config with another policy (validated)."""
        return replace(self.config, policy=P.check_policy(policy))

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """JSON-able state of every pod, for ``/debug/pods``."""
        out = []
        for name, b in sorted(self.backends.items()):
            out.append(
                {
                    "name": name,
                    "url": b.info.url,
                    "role": b.info.role,
                    "gpuModel": b.info.gpu_model,
                    "available": b.available(now),
                    "healthy": b.healthy,
                    "inflight": b.inflight,
                    "held": b.held,
                    "maxBatch": b.info.max_batch,
                    "batchCap": b.info.batch_cap,
                    "running": b.running,
                    "waiting": b.waiting,
                    "gpuUtil": b.gpu_util,
                    "kvUsage": b.kv_usage,
                    "itlMs": b.itl_ms,
                    "fastchatQueue": b.fc_queue,
                    "avoided": name in self.avoid,
                }
            )
        return out
