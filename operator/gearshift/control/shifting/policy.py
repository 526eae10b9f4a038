"""The numbers of the gear-shifting policy and the view of a gear that the decision and the executor use.

Every default is the API's (:class:`gearshift.api.shift_policy.ShiftPolicy`: FlexPipe's
(docs/sources.md#flexpipe), "Gear shifting" and "Executor" in DESIGN.md, unless its comment says otherwise);
the GearSet's ``spec.policy`` overrides each one (:func:`gearshift.control.shifting.adapt.policy_from_api`
builds a :class:`ShiftRules` from the API model, naming every field once).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gearshift.api.shift_policy import ShiftPolicy
from gearshift.control.smoothing import LatencyMetric
from gearshift.facts.errors import PolicyError
from gearshift.facts.model import ModelArch


class Intent(StrEnum):
    """What a gear is built for (DESIGN.md glossary)."""

    LATENCY = "latency"
    BALANCED = "balanced"
    THROUGHPUT = "throughput"


#: The API's defaults, which are the control code's: one definition of each number.
_API = ShiftPolicy()


@dataclass(frozen=True)
class ShiftRules:
    """All numbers of the shifting policy; times in s, latencies in ms, ratios as fractions.

    Field names and defaults are ``GearSet.spec.policy``'s (:class:`gearshift.api.shift_policy.ShiftPolicy`)
    in snake case; :func:`gearshift.control.shifting.adapt.policy_from_api` fills this from it. The schema
    refuses bad input first; the checks here are the schema's lower bounds and cross-field rules, for rules
    built without the API (the twin, the benchmarks), and ``tests/unit/test_control_adapt.py`` holds the two
    to the same answer (the schema's upper limits only bound typos: the control code can use any value).

    Raises:
        PolicyError: (at construction) a value outside its range, naming the ``spec.policy`` field.
    """

    target_p99_ms: float = 200.0
    """The P99 the latency triggers aim at, ms (DESIGN.md: target TTFT 200 ms)."""
    latency_metric: LatencyMetric = LatencyMetric.TTFT
    """Which P99: TTFT for the prefill role, ITL for decode (the PDService SLOs)."""
    sample_interval_s: float = _API.sample_interval_s
    ema_alpha: float = _API.ema_alpha
    enter_samples: int = _API.enter_samples
    exit_samples: int = _API.exit_samples
    dwell_s: float = _API.dwell_s
    imbalance_high_utilization: float = _API.imbalance_high_utilization
    """Some stage's smoothed utilisation above this ..."""
    imbalance_low_utilization: float = _API.imbalance_low_utilization
    """... while every other stage's is below this → throughput gear."""
    p99_high_ratio: float = _API.p99_high_ratio
    """Smoothed P99 above this × target → latency gear."""
    p99_low_ratio: float = _API.p99_low_ratio
    """Smoothed P99 below this × target → balanced gear."""
    saturation_queue: float = _API.saturation_queue
    """gearshift extension (the ``saturation`` trigger): smoothed waiting requests per pipeline replica
    above this, together with a P99 above ``p99HighRatio`` × target, mean the active gear cannot keep up
    with the load → the healthy gear with the most predicted throughput, if it beats the active one. Our
    default: one request waiting per replica on average over several samples (an engine that keeps up
    admits arrivals at its next step, so its waiting queue averages well below one)."""
    retrigger_step: float = _API.retrigger_step
    """One threshold level: moves the high thresholds up and the low ones down by this much (FlexPipe
    (docs/sources.md#shift-dwell)
    says "one step"; the size is gearshift's choice, the API's default)."""
    max_retrigger_steps: int = _API.max_retrigger_steps
    """Most levels a threshold can be raised (our choice; keeps ``p99LowRatio`` above 0)."""
    min_benefit_cost_ratio: float = _API.min_benefit_cost_ratio
    """A shift must promise at least this × its cost (both in seconds of full service) over the dwell;
    0 vetoes only shifts predicted to make things worse."""
    transfer_gbps: float = _API.transfer_gbps
    """Rate at which a shift moves weights and KV onto the new gear's cards, GB/s. Our default: the
    order of a local NVMe read; set it to the measured load rate of the cluster."""
    avg_context_tokens: int = _API.avg_context_tokens
    """Tokens of KV cache a running request holds on average (our default); prices the KV a shift moves."""
    warmup_share: float = _API.warmup_share
    """Largest share of traffic (and of a card's compute) a shadow gear gets while warming
    (docs/sources.md#shift-executor)."""
    warm_s: float = _API.warm_s
    """How long a shadow gear must have been Ready, taking its warm-up share, before traffic moves (our
    choice: a few hundred warm-up requests at typical rates)."""
    warmup_timeout_s: float = _API.warmup_timeout_s
    """A shadow gear not Ready and warm this long after the shift started is rolled back."""
    drain_timeout_s: float = _API.drain_timeout_s
    """Longest wait for the old gear's in-flight requests to finish."""
    rollback_window_s: float = _API.rollback_window_s
    """How long the old gear is kept after the switch so traffic can return to it. FlexPipe
    (docs/sources.md#shift-executor) keeps it
    "a few hundred ms" inside one engine; a pod-level switch needs tens of samples to judge P99."""
    rollback_p99_ratio: float = _API.rollback_p99_ratio
    """The new gear is rolled back when its measured P99 in the rollback window exceeds this × the larger
    of the old gear's measured P99 when the shift started and ``targetP99Ms`` (a gearshift choice: the
    planner's predicted P99 assumes its own request shape, not the trace's, so it is no yardstick)."""
    expected_arrival_rps: float = _API.expected_arrival_rps
    """The arrival rate a role expects when it starts, requests/s: with ``spec.initialGear`` unset it
    starts on the gear with the fewest GPUs predicted to meet the SLO at this rate."""
    capacity_headroom: float = _API.capacity_headroom
    """A gear is predicted to keep up with this × its predicted throughput (requests/s); measured bounds
    then correct it (:mod:`gearshift.control.shifting.capacity`). Our default, from
    ``bench/results/gears.json``: continuous batching keeps latency flat until close to saturation (the 2-card
    gear keeps up with 26-28 req/s of the trace as well as the 4-card gear, 0.90-0.97 × its predicted 28.75;
    the simulated engine serves it at 31.2, ``planner_vs_engine.json``); 0.8 shifted up early and spent
    2.75-3.45 GPU-hours where 0.9 spent 2.5 (``gears_headroom_0.8.json``)."""
    choice: str = _API.choice
    """``capacity``: the capacity controller chooses the gear (:mod:`gearshift.control.shifting.capacity`);
    ``thresholds``: the design source's triggers alone."""
    downshift_ratio: float = _API.downshift_ratio
    """``load-low`` shifts to a gear with fewer GPUs only while the smoothed arrival rate is below this ×
    that gear's capacity (a margin against shifting back up at the next bump)."""
    upshift_dwell_s: float = _API.upshift_dwell_s
    """``load-high``: least time since the last shift ended before a shift to a gear with more capacity.
    Shorter than ``dwellS`` on purpose, as Kubernetes' HPA scales up at once and down only after a
    stabilization window (``behavior.scaleDown.stabilizationWindowSeconds``, 300 s): too little capacity
    loses requests now, too much only costs GPU time."""
    allow_degraded: bool = _API.allow_degraded
    """Memory short for full shadows: load weights first, grow the KV pool after the switch
    (docs/sources.md#shift-executor)."""

    def __post_init__(self) -> None:
        def need(ok: bool, attr: str, rule: str) -> None:
            if not ok:
                raise PolicyError(f"spec.policy.{_camel(attr)} {rule}; got {getattr(self, attr)!r}")

        need(self.target_p99_ms > 0, "target_p99_ms", "must be > 0 ms")
        need(self.sample_interval_s > 0, "sample_interval_s", "must be > 0 s")
        need(0 < self.ema_alpha <= 1, "ema_alpha", "must be in (0, 1]")
        need(
            0 <= self.imbalance_low_utilization < self.imbalance_high_utilization <= 1,
            "imbalance_high_utilization",
            "must be above imbalanceLowUtilization and at most 1 (utilisation fractions)",
        )
        need(
            0 < self.p99_low_ratio < 1 < self.p99_high_ratio,
            "p99_high_ratio",
            "and p99LowRatio must satisfy 0 < p99LowRatio < 1 < p99HighRatio",
        )
        need(self.enter_samples >= 1, "enter_samples", "must be >= 1")
        need(self.exit_samples >= 1, "exit_samples", "must be >= 1")
        need(self.dwell_s >= 0, "dwell_s", "must be >= 0 s")
        need(self.retrigger_step >= 0, "retrigger_step", "must be >= 0")
        need(self.max_retrigger_steps >= 0, "max_retrigger_steps", "must be >= 0")
        # A low threshold stepped to zero or below would never fire again: keep every level meaningful.
        need(
            self.p99_low_ratio - self.max_retrigger_steps * self.retrigger_step > 0,
            "retrigger_step",
            "× maxRetriggerSteps must stay below p99LowRatio; lower one of them",
        )
        need(self.saturation_queue >= 0, "saturation_queue", "must be >= 0 requests")
        need(self.min_benefit_cost_ratio >= 0, "min_benefit_cost_ratio", "must be >= 0")
        need(self.transfer_gbps > 0, "transfer_gbps", "must be > 0 GB/s")
        need(self.avg_context_tokens >= 0, "avg_context_tokens", "must be >= 0")
        need(0 < self.warmup_share <= 1, "warmup_share", "must be in (0, 1]")
        need(self.warm_s >= 0, "warm_s", "must be >= 0 s")
        need(self.warmup_timeout_s > 0, "warmup_timeout_s", "must be > 0 s")
        need(self.drain_timeout_s > 0, "drain_timeout_s", "must be > 0 s")
        need(self.rollback_window_s >= 0, "rollback_window_s", "must be >= 0 s")
        need(self.rollback_p99_ratio > 1, "rollback_p99_ratio", "must be > 1")
        need(self.expected_arrival_rps >= 0, "expected_arrival_rps", "must be >= 0 requests/s")
        need(0 < self.capacity_headroom <= 1, "capacity_headroom", "must be in (0, 1]")
        need(self.choice in ("capacity", "thresholds"), "choice", "must be capacity or thresholds")
        need(0 < self.downshift_ratio <= 1, "downshift_ratio", "must be in (0, 1]")
        need(self.upshift_dwell_s >= 0, "upshift_dwell_s", "must be >= 0 s")


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(w.capitalize() for w in rest)


@dataclass(frozen=True)
class StageView:
    """One stage of a gear as the controller needs it: its layer range ``[start, end)`` and replicas."""

    start: int
    end: int
    replicas: int = 1
    gpus: int = 1
    """GPUs of one replica of the stage (tensor parallel)."""


@dataclass(frozen=True)
class GearView:
    """One gear of a GearSet, reduced to what the shift decision and executor read.

    ``predicted_throughput_rps`` (requests/s) and ``predicted_p99_ms`` come from the planner's simulator
    (or the GearSet spec); ``None`` means not known, and then the cost–benefit check cannot veto.
    """

    name: str
    intent: Intent
    stages: tuple[StageView, ...]
    predicted_throughput_rps: float | None = None
    predicted_p99_ms: float | None = None
    prompt_tokens_per_s: float | None = None
    """The planner's linear work model (``predicted.promptTokensPerS``, ``outputTokensPerS``): a request of
    ``p`` prompt and ``o`` output tokens keeps the gear busy ``p / prompt_tokens_per_s + o /
    output_tokens_per_s`` s; ``None``: the gear's capacity is mix-blind (requests/s only)."""
    output_tokens_per_s: float | None = None
    ttft_ms_per_prompt_token: float | None = None
    """Unloaded time to first token per prompt token on the gear's fastest cards, ms."""
    healthy: bool = True
    unhealthy_reason: str = ""

    @property
    def gpus(self) -> int:
        """GPUs the gear holds: every replica of every stage."""
        return sum(s.replicas * s.gpus for s in self.stages)

    @property
    def pipelines(self) -> int:
        """Pipeline replicas (head pods): stage 0's replicas, at least 1."""
        return max(1, self.stages[0].replicas) if self.stages else 1

    def busy_rps(self, prompt_tokens: float | None, output_tokens: float | None) -> float | None:
        """Requests/s of a mix of ``prompt_tokens`` and ``output_tokens`` per request the gear serves when
        busy all the time, by its linear work model (a prefill gear's prompts side alone, a decode gear's
        outputs side); the planner's predicted throughput when the mix or the model is not known;
        ``None`` without a prediction."""
        pt, ot = self.prompt_tokens_per_s, self.output_tokens_per_s
        if (pt is None and ot is None) or (pt is not None and prompt_tokens is None):
            return self.predicted_throughput_rps
        if ot is not None and output_tokens is None:
            return self.predicted_throughput_rps
        # A PD role has one side (prefill: prompts; decode: outputs); an aggregated gear both.
        busy_s = (0.0 if pt is None else max(prompt_tokens or 0.0, 0.0) / pt) + (
            0.0 if ot is None else max(output_tokens or 0.0, 0.0) / ot
        )
        return self.predicted_throughput_rps if busy_s <= 0 else 1.0 / busy_s

    def weight_bytes(self, arch: ModelArch) -> int:
        """Weights all pods of this gear load, bytes (every replica of every stage)."""
        return sum(s.replicas * arch.stage_weight_bytes(s.start, s.end) for s in self.stages)

    def pod_weight_bytes(self, arch: ModelArch) -> int:
        """Weights the gear's largest stage pod loads, bytes: pods load at once, each on its own node, so
        the slowest of them sets when the gear can serve (0 for a gear without stages)."""
        return max((arch.stage_weight_bytes(s.start, s.end) for s in self.stages), default=0)


@dataclass(frozen=True)
class GearTable:
    """The gears of one GearSet, which one serves traffic now, and the served model."""

    gears: tuple[GearView, ...]
    active: str
    arch: ModelArch

    def get(self, name: str) -> GearView | None:
        """The gear called ``name``, or ``None``."""
        return next((g for g in self.gears if g.name == name), None)

    @property
    def active_gear(self) -> GearView:
        """The active gear.

        Raises:
            KeyError: ``active`` names no gear of the table.
        """
        gear = self.get(self.active)
        if gear is None:
            raise KeyError(f"active gear {self.active!r} is not among {[g.name for g in self.gears]}")
        return gear
