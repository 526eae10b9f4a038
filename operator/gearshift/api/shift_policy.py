"""The gear-shifting policy of a GearSet (``spec.policy``): when to shift gears and how to execute a shift.

The schema is where a bad value is refused: every range here is one the control code can use
(:class:`gearshift.control.shifting.policy.ShiftRules` checks the same ranges for rules built without the API,
and ``tests/unit/test_control_adapt.py`` holds the two to the same answer). Each cross-field rule is written
twice, as a pydantic validator and in :data:`CEL` as an ``x-kubernetes-validations`` rule of the CRD.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from gearshift.api.common import SpecModel

#: Rules of the CRD, per model, as ``x-kubernetes-validations`` entries; read by :mod:`gearshift.api.crdgen`.
CEL: dict[str, list[dict[str, str]]] = {
    "ShiftPolicy": [
        {
            "rule": "self.imbalanceLowUtilization < self.imbalanceHighUtilization",
            "message": "imbalanceLowUtilization must be below imbalanceHighUtilization",
            "messageExpression": "'imbalanceLowUtilization (%s) must be below imbalanceHighUtilization (%s)'"
            ".format([self.imbalanceLowUtilization, self.imbalanceHighUtilization])",
            "fieldPath": ".imbalanceLowUtilization",
        },
        {
            # A low threshold stepped to zero or below would never fire again: keep every level meaningful.
            "rule": "self.p99LowRatio - double(self.maxRetriggerSteps) * self.retriggerStep > 0.0",
            "message": "retriggerStep x maxRetriggerSteps must stay below p99LowRatio; lower one of them",
            "messageExpression": "'retriggerStep (%s) x maxRetriggerSteps (%d) must stay below p99LowRatio "
            "(%s); lower one of them'.format([self.retriggerStep, self.maxRetriggerSteps, self.p99LowRatio])",
            "fieldPath": ".retriggerStep",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


class ShiftPolicy(SpecModel):
    """When to shift gears and how to execute a shift. Defaults are FlexPipe's numbers unless noted
    (docs/sources.md#flexpipe)."""

    model_config = ConfigDict(json_schema_extra=_cel("ShiftPolicy"))

    sample_interval_s: float = Field(
        default=2.0,
        gt=0,
        le=3600,
        description="Seconds between signal samples (docs/sources.md#shift-signals: 2 s).",
    )
    ema_alpha: float = Field(
        default=0.3,
        gt=0,
        le=1,
        description="Weight of the newest sample in the EMA (docs/sources.md#shift-signals: 0.3).",
    )
    enter_samples: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Consecutive samples a trigger must hold to fire (docs/sources.md#shift-signals: 3).",
    )
    exit_samples: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Consecutive samples another trigger must hold to leave the new gear "
        "(docs/sources.md#shift-signals: 3).",
    )
    dwell_s: float = Field(
        default=600.0,
        ge=0,
        le=86400,
        description="Minimum seconds a gear stays active (docs/sources.md#shift-dwell: 10 min).",
    )
    imbalance_high_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Imbalance trigger: some stage's utilisation above this ... "
        "(docs/sources.md#shift-triggers: 0.9).",
    )
    imbalance_low_utilization: float = Field(
        default=0.6,
        ge=0,
        lt=1,
        description="... while every other stage is below this -> throughput gear "
        "(docs/sources.md#shift-triggers: 0.6).",
    )
    p99_high_ratio: float = Field(
        default=1.2,
        gt=1,
        le=100,
        description="P99 above this x target -> latency gear (docs/sources.md#shift-triggers: 1.2); above 1.",
    )
    p99_low_ratio: float = Field(
        default=0.7,
        gt=0,
        lt=1,
        description="P99 below this x target -> balanced gear (docs/sources.md#shift-triggers: 0.7); below "
        "1.",
    )
    saturation_queue: float = Field(
        default=1.0,
        ge=0,
        le=1e6,
        description="Saturation trigger (gearshift extension): P99 above p99HighRatio x target while more "
        "than this many requests wait per pipeline replica (smoothed) -> the gear with the most predicted "
        "throughput, if more than the active gear's.",
    )
    target_p99_ms: float | None = Field(
        default=None,
        gt=0,
        le=1e7,
        description="Target of the P99 triggers, ms; unset: the PDService SLO (ttftMs for prefill "
        "and both, itlMs for decode).",
    )
    retrigger_step: float = Field(
        default=0.05,
        ge=0,
        le=10,
        description="A trigger firing again inside the dwell moves its threshold this much away from "
        "firing (FlexPipe says 'one step', docs/sources.md#shift-signals; the size is gearshift's choice).",
    )
    min_benefit_cost_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1e6,
        description="Veto a shift unless its predicted gain over one dwell is at least this x its cost "
        "(weights and KV moved, docs/sources.md#shift-cost); 0 disables the check.",
    )
    warmup_share: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Share of live requests' load a warming shadow gets (docs/sources.md#shift-executor: "
        "20%): the router mirrors "
        "requests to its head pods at up to warmupShare x the gear's predicted throughput (answers dropped; "
        "clients never see them) while it is Ready for warmS. The card-time share is not enforced on the "
        "GPU (the benchmark models it).",
    )
    warm_s: float = Field(
        default=30.0,
        ge=0,
        le=86400,
        description="How long a shadow gear must have been Ready before traffic moves to it, s (gearshift's "
        "choice: a few hundred warm-up requests at typical rates).",
    )
    warmup_timeout_s: float = Field(
        default=600.0, gt=0, le=86400, description="Shadows not ready and warm by then -> roll back, s."
    )
    max_retrigger_steps: int = Field(
        default=3,
        ge=0,
        le=100,
        description="Most steps a threshold can be raised by re-triggers inside the dwell "
        "(gearshift's choice).",
    )
    transfer_gbps: float = Field(
        default=2.0,
        gt=0,
        le=1e5,
        description="Rate one pod of a shift's new gear loads its weights and KV, GB/s (pods load at once, "
        "so the largest stage sets the shift's cost in the cost-benefit check; default: a local NVMe read; "
        "set the cluster's measured per-node load rate).",
    )
    avg_context_tokens: int = Field(
        default=1024,
        ge=0,
        le=10_000_000,
        description="KV-cache tokens a running request holds on average (prices the KV a shift moves).",
    )
    drain_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86400,
        description="Longest wait for in-flight requests on the old gear to finish, s.",
    )
    rollback_window_s: float = Field(
        default=60.0,
        ge=0,
        le=86400,
        description="How long the old gear is kept after the switch to roll back to, s (FlexPipe "
        "(docs/sources.md#shift-executor) keeps a "
        "few hundred ms inside one engine; across pods gearshift needs enough samples to judge P99).",
    )
    rollback_p99_ratio: float = Field(
        default=2.0,
        gt=1,
        le=100,
        description="Within the rollback window, the new gear's measured P99 above this x max(the old "
        "gear's measured P99 when the shift started, the target P99) rolls back.",
    )
    expected_arrival_rps: float = Field(
        default=0.0,
        ge=0,
        le=1e6,
        description="Arrival rate the role expects when it starts, req/s: with initialGear unset it starts "
        "on the gear with the fewest GPUs predicted to meet the P99 target at this rate.",
    )
    capacity_headroom: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="A gear is predicted to meet the P99 target up to this x its predicted throughput "
        "(req/s) until it has measured its own capacity; the load-high/load-low triggers compare the "
        "smoothed arrival rate with that capacity (status.control.capacity).",
    )
    choice: Literal["capacity", "thresholds"] = Field(
        default="capacity",
        description="How the target gear is chosen. capacity: the gear with the fewest GPUs predicted to "
        "meet the SLO for the observed traffic mix and rate (load-high/load-low, each gear's capacity "
        "corrected by what it measured), the threshold triggers' EMA, hysteresis and dwell around it. "
        "thresholds: the design source's triggers alone (imbalance, saturation, p99-high, p99-low by gear "
        "intent; docs/sources.md#shift-triggers), no capacity model.",
    )
    downshift_ratio: float = Field(
        default=0.75,
        gt=0,
        le=1,
        description="load-low shifts to a gear with fewer GPUs only while the arrival rate is below this x "
        "that gear's capacity (a margin against shifting back up at the next bump).",
    )
    upshift_dwell_s: float = Field(
        default=60.0,
        ge=0,
        le=86400,
        description="Least seconds after a shift ends before a shift to a gear with more capacity (as the "
        "HPA scales up at once and down after a stabilization window, dwellS governs the way down).",
    )
    allow_degraded: bool = Field(
        default=True,
        description="When memory is short for full shadows, load weights first and grow the KV pool after "
        "the switch (FlexPipe's degraded mode, docs/sources.md#shift-executor) instead of refusing the "
        "shift.",
    )

    @model_validator(mode="after")
    def _check_thresholds(self) -> ShiftPolicy:
        if self.imbalance_low_utilization >= self.imbalance_high_utilization:
            raise ValueError(
                f"imbalanceLowUtilization ({self.imbalance_low_utilization}) must be below "
                f"imbalanceHighUtilization ({self.imbalance_high_utilization})"
            )
        if self.p99_low_ratio - self.max_retrigger_steps * self.retrigger_step <= 0:
            raise ValueError(
                f"retriggerStep ({self.retrigger_step}) x maxRetriggerSteps ({self.max_retrigger_steps}) "
                f"must stay below p99LowRatio ({self.p99_low_ratio}); lower one of them"
            )
        return self
