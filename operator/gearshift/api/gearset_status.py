"""The parts of a GearSet's status: the smoothed signals, gear health, shift history, the executor's and
the decision loop's persisted state, the autoscaler's and the adaptive batch's reports, windowed nodes.

:class:`gearshift.api.gearset.GearSetStatus`, which holds them (and the planned gears), sits with the
GearSet root in :mod:`gearshift.api.gearset`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, Field

from gearshift.api.common import MAX_GEARS, MAX_STAGES, Message, StatusModel

#: ``Pending``: no gear serves yet. The six others are FlexPipe's executor states
#: (docs/sources.md#shift-executor).
GearPhase = Literal["Pending", "Stable", "Warming", "Draining", "Switching", "RollingBack", "Degraded"]
ShiftTrigger = Literal[
    "imbalance",
    "saturation",
    "p99-high",
    "p99-low",
    "load-high",
    "load-low",
    "forced",
    "initial",
    "replan",
    "window",
    "rollback",
]
ShiftOutcome = Literal["InProgress", "Succeeded", "RolledBack", "Failed", "Aborted"]
#: Where ``status.signals.stageUtilization`` comes from (``gearshift.control.signals.UtilizationSource``).
StageUtilizationSource = Literal["engine", "derived", "none"]

#: Longest ``status.signals.skipped`` the schema takes (the writer cuts to it).
SKIPPED_MAX_CHARS = 1024


class GearSignals(StatusModel):
    """The smoothed (EMA) signals of the last sample."""

    sample_time: AwareDatetime | None = Field(default=None, description="When the sample was taken.")
    qps: float | None = Field(default=None, description="Requests/s over the last minute.")
    p99_ms: float | None = Field(
        default=None,
        description="P99 the triggers compare with the target: TTFT for prefill and both, ITL for decode, "
        "ms.",
    )
    p50_ttft_ms: float | None = Field(default=None, description="P50 time to first token, ms.")
    p99_ttft_ms: float | None = Field(default=None, description="P99 time to first token, ms.")
    p50_itl_ms: float | None = Field(default=None, description="P50 inter-token latency, ms.")
    p99_itl_ms: float | None = Field(default=None, description="P99 inter-token latency, ms.")
    p50_e2e_ms: float | None = Field(
        default=None, alias="p50E2eMs", description="P50 end-to-end request latency, ms."
    )
    p99_e2e_ms: float | None = Field(
        default=None, alias="p99E2eMs", description="P99 end-to-end request latency, ms."
    )
    prompt_tokens_mean: float | None = Field(
        default=None,
        description="Mean prompt tokens per request of the role's traffic, smoothed like qps: rate of "
        "vllm:request_prompt_tokens_sum / _count over the window, from the router's client-facing "
        "histogram, else the gear's engines'; null when not measured yet.",
    )
    output_tokens_mean: float | None = Field(
        default=None,
        description="Mean generated tokens per finished request, smoothed: vllm:request_generation_tokens, "
        "from the same source as promptTokensMean; null when not measured yet.",
    )
    queue_length: float | None = Field(default=None, description="Waiting requests per pipeline replica.")
    kv_cache_usage: float | None = Field(default=None, description="KV-cache usage, 0..1.")
    stage_utilization: list[float] = Field(
        default_factory=list,
        max_length=MAX_STAGES,
        description="Utilisation of each stage, 0..1, in order; empty when not known.",
    )
    stage_utilization_source: StageUtilizationSource | None = Field(
        default=None,
        description="Where stageUtilization comes from: engine (the simulated engine measures and "
        "exports each stage's busy fraction), derived (vLLM exports none: the head's seat occupancy, "
        "pipelineUtilization, times each stage's predictedTimeMs / the bottleneck's), none (not known "
        "this sample, e.g. a multi-stage vLLM gear without predictedTimeMs: the imbalance trigger is off; "
        "the SignalsAvailable condition says why).",
    )
    pipeline_utilization: float | None = Field(
        default=None,
        description="vLLM only: the head engine's seat occupancy in the last sample (not smoothed), 0..1: "
        "mean requests in execution over the window (rate of vllm:request_prefill_time_seconds_sum + "
        "vllm:request_decode_time_seconds_sum per head engine) / maxBatch (--max-num-seqs).",
    )
    skipped: str | None = Field(
        default=None,
        max_length=SKIPPED_MAX_CHARS,
        description="Why this tick has no sample (Prometheus unreachable, a series the controller reads "
        "is missing): sampleTime is the tick's and every value is null, as the SignalsAvailable "
        "condition also says; null when the sample was taken. The status advances every sample "
        "interval either way.",
    )
    missed_samples: int | None = Field(
        default=None,
        ge=0,
        description="Sample instants the shifting loop let pass since the operator started, because a "
        "turn took longer than spec.policy.sampleIntervalS (a slow API server or a busy machine); 0 while "
        "it keeps pace. Also counted by gearshift_operator_samples_missed_total.",
    )


class GearHealth(StatusModel):
    """Whether a gear may be shifted to; unhealthy until the model or the profiles change
    (docs/sources.md#gear-health)."""

    gear: str = Field(max_length=63, description="Gear name.")
    healthy: bool = Field(description="False after OOM, crash loops or severe timeouts.")
    reason: str = Field(
        default="", max_length=1024, description="CamelCase reason (OOMKilled, Timeout, ...)."
    )
    message: Message = Field(default="", description="Details.")
    since: AwareDatetime | None = Field(default=None, description="When the gear was last marked.")
    profiles_hash: str | None = Field(
        default=None,
        max_length=128,
        description="GPUProfiles fingerprint when marked; a different one clears the mark.",
    )
    gear_hash: str | None = Field(
        default=None,
        max_length=128,
        description="Fingerprint of the gear's spec when marked; editing the gear clears the mark.",
    )


class ShiftRecord(StatusModel):
    """One gear shift, for history and events."""

    from_gear: str | None = Field(default=None, alias="from", max_length=63, description="Gear shifted from.")
    to_gear: str = Field(alias="to", max_length=63, description="Gear shifted to.")
    trigger: ShiftTrigger = Field(description="What started the shift.")
    started_at: AwareDatetime = Field(description="When the shift started.")
    finished_at: AwareDatetime | None = Field(default=None, description="When it ended.")
    outcome: ShiftOutcome = Field(default="InProgress", description="How it ended.")
    message: Message = Field(default="", description="Details.")


class ExecutorState(StatusModel):
    """The gear executor's persisted state, so an operator restart resumes a shift where it stopped."""

    step: GearPhase = Field(default="Stable", description="Current executor step.")
    from_gear: str | None = Field(default=None, max_length=63, description="Gear being left.")
    to_gear: str | None = Field(default=None, max_length=63, description="Gear being entered.")
    trigger: ShiftTrigger | None = Field(default=None, description="Trigger of the shift in progress.")
    started_at: AwareDatetime | None = Field(default=None, description="When the shift started.")
    step_started_at: AwareDatetime | None = Field(default=None, description="When the current step started.")
    deadline: AwareDatetime | None = Field(default=None, description="When the current step times out.")
    rollback_until: AwareDatetime | None = Field(default=None, description="End of the rollback window.")
    degraded: bool = Field(default=False, description="Shadows run weights-only; KV pool grows after.")
    attempt: int = Field(default=0, ge=0, description="Retries of the current step.")
    in_flight: int | None = Field(
        default=None,
        ge=0,
        description="Requests still on the gear being drained (the old gear while Draining, the failed "
        "gear while RollingBack).",
    )
    predicted_p99_ms: float | None = Field(
        default=None, ge=0, le=1e7, description="The target gear's predicted P99 (informational), ms."
    )
    baseline_p99_ms: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="The old gear's measured P99 when the shift started (the rollback check's "
        "yardstick), ms.",
    )
    baseline_qps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="The old gear's served rate when the shift started, completed requests/s: a "
        "saturation shift's new gear serving at least this much is not rolled back on P99.",
    )
    failure: str | None = Field(
        default=None, max_length=1024, description="CamelCase reason of the rollback in progress."
    )
    failure_message: Message = Field(default="", description="Why it rolls back.")
    paused_at: AwareDatetime | None = Field(
        default=None, description="When spec.paused held the shift (deadlines are extended by the pause)."
    )


class GearCapacity(StatusModel):
    """One gear's SLO capacity: what the planner predicted and what the gear measured while it
    served (gearshift.control.shifting.capacity)."""

    gear: str = Field(max_length=63, description="Gear name.")
    predicted_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Requests/s of the workload the gear was planned for (spec.plan.workload), as every "
        "rate here: the observed mix converts them with the gear's promptTokensPerS/outputTokensPerS. "
        "policy.capacityHeadroom (less when the mix's prompts take much of the TTFT target to prefill) x "
        "the planner's predicted throughput (0: its "
        "predicted P99 misses the target).",
    )
    measured_low_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Highest smoothed arrival rate it served within the P99 target with no backlog, req/s.",
    )
    measured_high_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Lowest smoothed arrival (or, saturated, completion) rate at which a saturation or "
        "p99-high trigger latched on it, req/s.",
    )
    capacity_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="The estimate the controller uses: predictedRps clamped into the measured bounds, "
        "req/s (informational; recomputed from the three above).",
    )
    updated_time: AwareDatetime | None = Field(default=None, description="When a bound last changed.")
    pending_low_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Least arrival rate of the current run of within-target samples above measuredLowRps; "
        "it becomes measuredLowRps after 60 s (the P99's window).",
    )
    pending_since: AwareDatetime | None = Field(default=None, description="When that run started.")
    pending_high_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Most the gear completed per second in the current run of overloaded samples; it "
        "becomes measuredHighRps after 60 s of overload (a burst shorter than the rates' window reads low).",
    )
    pending_high_since: AwareDatetime | None = Field(default=None, description="When that run started.")


class ControlState(StatusModel):
    """The decision loop's persisted memory: EMA values, hysteresis streaks, raised thresholds."""

    capacity: list[GearCapacity] = Field(
        default_factory=list,
        max_length=MAX_GEARS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["gear"]},
        description="Per gear: predicted and measured SLO capacity (the load-high / load-low triggers).",
    )

    ema: dict[str, float] = Field(
        default_factory=dict, max_length=64, description="Smoothed value per signal name."
    )
    streaks: dict[str, int] = Field(
        default_factory=dict, max_length=16, description="Consecutive samples each trigger has held."
    )
    threshold_steps: dict[str, int] = Field(
        default_factory=dict,
        max_length=16,
        description="Steps each trigger's threshold was raised by re-triggers inside the dwell.",
    )
    off_streaks: dict[str, int] = Field(
        default_factory=dict,
        max_length=16,
        description="Consecutive samples each trigger has not held (hysteresis on the way out).",
    )
    latched: list[str] = Field(
        default_factory=list, max_length=16, description="Triggers latched by hysteresis now."
    )
    dwell_until: AwareDatetime | None = Field(default=None, description="No shift before this time.")
    last_shift_time: AwareDatetime | None = Field(
        default=None, description="When the last shift was decided (the dwell counts from it)."
    )
    last_retrigger_time: AwareDatetime | None = Field(
        default=None,
        description="When a trigger last fired inside the dwell (raised thresholds reset "
        "one dwell after it).",
    )


class ScalingStatus(StatusModel):
    """The pipeline-replica autoscaler's report and memory (``PDService.spec.<role>.scaling``)."""

    desired_replicas: int | None = Field(default=None, ge=0, description="Pipeline replicas asked for.")
    ready_replicas: int | None = Field(default=None, ge=0, description="Pipeline replicas Ready.")
    last_decision: str | None = Field(
        default=None, max_length=64, description="Hold, ScaleUp or ScaleDown (the latest decision)."
    )
    last_reason: str | None = Field(default=None, max_length=128, description="CamelCase reason of it.")
    last_message: Message = Field(default="", description="Details of it.")
    last_scale_time: AwareDatetime | None = Field(default=None, description="When replicas last changed.")
    up_since: AwareDatetime | None = Field(default=None, description="Start of the scale-up window run.")
    up_floor: int | None = Field(default=None, ge=0, description="Lowest recommendation in that run.")
    down_since: AwareDatetime | None = Field(default=None, description="Start of the scale-down window run.")
    down_ceiling: int | None = Field(default=None, ge=0, description="Highest recommendation in that run.")
    idle_since: AwareDatetime | None = Field(default=None, description="Since when nothing runs or waits.")
    router_rejections: float | None = Field(
        default=None, ge=0, description="Router no-decode-headroom counter at the last read (its baseline)."
    )
    draining: list[str] = Field(
        default_factory=list, max_length=1024, description="Head pods being drained for a scale-down."
    )
    drain_target: int | None = Field(default=None, ge=0, description="Replicas the drain scales down to.")
    drain_started_at: AwareDatetime | None = Field(default=None, description="When the drain began.")
    placement: Message = Field(default="", description="Nodes the last scale-up expects its new pods on.")


class MaxBatchChange(StatusModel):
    """One change of the serving gear's effective max batch."""

    time: AwareDatetime = Field(description="When it changed.")
    from_value: int | None = Field(
        default=None, alias="from", ge=1, description="Effective max batch before (none: a new gear)."
    )
    to_value: int = Field(alias="to", ge=1, description="Effective max batch after.")
    reason: str = Field(max_length=128, description="CamelCase reason (ItlOverTarget, GearChanged, ...).")
    message: Message = Field(default="", description="Details: the router's proposal and its ITL.")
    pod: str | None = Field(
        default=None, max_length=253, description="Head pod whose cap changed (none: the whole gear)."
    )


class PodMaxBatch(StatusModel):
    """One head pod's adaptive max batch (its own ITL and backlog step it: the PD guide's per-node rule
    (docs/sources.md#adaptive-batch))."""

    pod: str = Field(max_length=253, description="Head pod name.")
    effective: int = Field(ge=1, description="Max batch in force on this pod.")
    per_router: int = Field(ge=1, description="What each router replica lets this pod run at once.")
    last_change_time: AwareDatetime | None = Field(
        default=None, description="When this pod's value last changed (its cooldown counts from it)."
    )


class AdaptiveBatchStatus(StatusModel):
    """The PD guide's adaptive batch on the active gear (docs/sources.md#adaptive-batch) (decode role;
    gearshift.control.adaptive_batch.tick): the
    router caps each head pod's concurrent requests at that pod's own effective value (``pods``; annotation
    ``gearshift.io/max-batch``, divided among router replicas); the engines keep their ``--max-num-seqs``
    (``planned``), so no pod restarts and no request is dropped."""

    gear: str = Field(max_length=63, description="Gear the values are for (the active gear).")
    planned: int = Field(ge=1, description="The gear's maxBatch, the engine's own limit: the ceiling.")
    effective: int = Field(
        ge=1, description="Lowest max batch in force over the head pods (each pod's own value: pods)."
    )
    floor: int = Field(ge=1, description="Least effective value: max(1, microBatch, ceil(planned / 4)).")
    per_router: int = Field(
        ge=1, description="Requests each router replica keeps at once on the most capped head pod."
    )
    pods: list[PodMaxBatch] = Field(
        default_factory=list,
        max_length=256,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
        description="Each head pod's max batch (the annotation the router reads is its perRouter).",
    )
    last_decision: Literal["Lower", "Raise", "Hold", "Reset"] = Field(description="The latest decision.")
    last_reason: str = Field(max_length=128, description="CamelCase reason of it (Cooldown, AtFloor, ...).")
    last_message: Message = Field(default="", description="Details of it.")
    last_decision_time: AwareDatetime | None = Field(
        default=None,
        description="When the latest decision that changed this status was taken (a decision that repeats "
        "the previous one, every 5 s, is not written again).",
    )
    last_change_time: AwareDatetime | None = Field(
        default=None, description="When any head pod's value last changed."
    )
    history: list[MaxBatchChange] = Field(
        default_factory=list, max_length=10, description="Recent changes, oldest first; at most 10."
    )


class WindowedNode(StatusModel):
    """A time-limited node of this role: its deadline, what runs on it, when work leaves it."""

    node: str = Field(max_length=253, description="Node name.")
    available_until: AwareDatetime = Field(description="When the node is reclaimed (its GPUProfile).")
    leave_by: AwareDatetime = Field(
        description="When work must leave it: availableUntil - windowMarginS - max(dwellS, warmS + "
        "drainTimeoutS + rollbackWindowS); from then on the planner leaves it out and the executor shifts "
        "the serving gear off it (trigger window)."
    )
    stages: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list,
        max_length=64,
        description="What runs on it: '<gear>/s<k>' of the planned gears (empty: nothing).",
    )
    state: Literal["InUse", "Unused", "Leaving", "Left"] = Field(
        default="Unused",
        description="InUse (a gear places work on it), Unused, Leaving (past leaveBy; the serving gear is "
        "being shifted off it), Left (past leaveBy, nothing on it).",
    )
