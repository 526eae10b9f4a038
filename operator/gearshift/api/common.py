"""Shared pieces of the three custom resources: base model configs, status conditions and their setter,
condition types, event reasons, name limits and a formatter for validation errors.

Conditions follow the Kubernetes API conventions (``metav1.Condition``): ``type``, ``status``
(``True|False|Unknown``), ``reason`` (CamelCase), ``message``, ``lastTransitionTime`` and
``observedGeneration``. :func:`set_condition` is the only way gearshift changes them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from gearshift import GROUP, VERSION  # the one place of the API group and version

#: The kinds' ``apiVersion`` as a type: a Literal cannot be built from GROUP and VERSION, so it repeats them.
ApiVersion = Literal["gearshift.io/v1alpha1"]
API_VERSION = cast(ApiVersion, f"{GROUP}/{VERSION}")

# --- name limits derived from the name templates (DESIGN.md) --------------------------------------
#: A StatefulSet's name must leave room for the ``controller-revision-hash`` label value
#: ``<sts>-<10-char hash>`` within the 63-character label limit (kubernetes/kubernetes#64023).
MAX_STATEFULSET_NAME = 52
#: Longest PDService name; also bounds GearSet ``serviceName``.
MAX_SERVICE_NAME = 24
#: ``<pds>-<role>-<gear>-s<k>``: the longest role is ``prefill`` and k has at most 2 digits.
MAX_GEAR_NAME = MAX_STATEFULSET_NAME - MAX_SERVICE_NAME - len("-prefill-") - len("-s99")
#: Kubernetes object names (DNS subdomain) and node names.
MAX_OBJECT_NAME = 253
#: DNS-1123 label: lowercase alphanumerics and '-', starting and ending alphanumeric.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A label value (empty, or alphanumerics with '-', '_', '.' inside).
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"

# --- bounds that keep CEL cost estimates finite (the API server rejects unbounded ones) -----------
MAX_GEARS = 16
MAX_STAGES = 64
MAX_NODES_PER_STAGE = 64
MAX_SELECTOR_LABELS = 16
MAX_CONDITIONS = 16
MAX_HISTORY = 50
MAX_PEERS = 256
MAX_MESSAGE = 32768
"""A condition message's maxLength (Kubernetes API conventions: ``metav1.Condition.message``)."""


def bounded(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was left out; unchanged when it fits.

    Messages the operator writes list what they found (missing nodes, stages, pods); a list the user's
    spec makes long must not make the status write fail schema validation on every reconcile.
    """
    if len(text) <= limit:
        return text
    if limit < 80:  # too short to say what was cut and keep some text: a plain cut
        return text[: max(0, limit)]
    # The suffix's own length depends on the count; 40 characters always hold it.
    keep = limit - 40
    return f"{text[:keep]}… ({len(text) - keep} more characters)"


def inputs_hash(*parts: Any) -> str:
    """A 16-hex-digit SHA-256 fingerprint of JSON-serialisable ``parts`` (key order does not matter): what
    a plan depends on (``status.profilesHash``), a gear's spec (``gearHealth.gearHash``), a pod template."""
    raw = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _bounded_input(value: Any) -> Any:
    return bounded(value) if isinstance(value, str) else value


#: A status message the operator writes: cut to :data:`MAX_MESSAGE` on the way in (never a validation
#: error), and ``maxLength`` in the CRD.
Message = Annotated[str, BeforeValidator(_bounded_input), Field(max_length=MAX_MESSAGE)]


M = TypeVar("M", bound=BaseModel)

DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]
NodeName = Annotated[str, Field(min_length=1, max_length=MAX_OBJECT_NAME)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
Selector = Annotated[dict[str, LabelValue], Field(max_length=MAX_SELECTOR_LABELS)]


class SpecModel(BaseModel):
    """Base of user-written spec parts: frozen, camelCase, unknown fields and type coercion refused.

    Strict types mirror the API server, which refuses ``"3"`` or ``3.0`` for an integer; unknown fields are
    refused as ``kubectl apply`` (strict field validation) refuses them.
    """

    model_config = ConfigDict(
        frozen=True,
        populate_by_name=True,
        alias_generator=to_camel,
        extra="forbid",
        strict=True,
        use_enum_values=True,
    )

    def to_json(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(BaseModel):
    """Base of operator-written status parts: mutable, camelCase, tolerant of fields it does not know.

    Unlike :class:`SpecModel`, reading a status never fails on extra keys (kopf or a newer operator may
    have written them).
    """

    model_config = ConfigDict(
        populate_by_name=True,
        alias_generator=to_camel,
        extra="ignore",
        use_enum_values=True,
    )

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON patch body: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- conditions ---------------------------------------------------------------------------------
ConditionStatus = Literal["True", "False", "Unknown"]

#: The object serves (PDService: router and both roles ready; GPUProfile: a usable profile exists;
#: GearSet: the active gear's pods are ready).
COND_READY = "Ready"
#: Every stage of the active gears is placed on nodes that satisfy it (PDService, GearSet).
COND_PLACED = "Placed"
#: A change is being rolled out: a shift, a scale, a spec edit (PDService, GearSet).
COND_PROGRESSING = "Progressing"
#: Serving with less than planned: a lost node, an unhealthy gear, short memory (all kinds).
COND_DEGRADED = "Degraded"
#: The planner produced gears for an ``auto`` GearSet from the current GPUProfiles.
COND_PLANNED = "Planned"
#: Prometheus answered and every signal the triggers need is present (GearSet).
COND_SIGNALS_AVAILABLE = "SignalsAvailable"
#: The TTFT target is within reach of some gear for the traffic arriving: False while at least 1 % of the
#: requests have prompts longer than any gear prefills within it (GearSet; gearshift.control.shifting).
COND_LATENCY_ATTAINABLE = "LatencyAttainable"
#: The latest probe of the node succeeded and its numbers are in status (GPUProfile).
COND_PROBED = "Probed"
#: The node is gone or its GPUs changed since the last probe (GPUProfile).
COND_STALE = "Stale"
#: The node has a known reclaim time (a "time fragment") (GPUProfile).
COND_WINDOWED = "Windowed"
#: The autoscaler could act within its limits (PDService).
COND_SCALING_ACTIVE = "ScalingActive"
#: The router caps the active gear's head pods below the gear's planned max batch (GearSet, decode).
COND_BATCH_ADAPTED = "BatchAdapted"

CONDITION_TYPES: tuple[str, ...] = (
    COND_READY,
    COND_PLACED,
    COND_PROGRESSING,
    COND_DEGRADED,
    COND_PLANNED,
    COND_SIGNALS_AVAILABLE,
    COND_LATENCY_ATTAINABLE,
    COND_PROBED,
    COND_STALE,
    COND_WINDOWED,
    COND_SCALING_ACTIVE,
    COND_BATCH_ADAPTED,
)

# --- event (and condition) reasons, CamelCase as Kubernetes wants them -----------------------------
REASON_PROBE_STARTED = "ProbeStarted"  # a probe Job was created for the node
REASON_PROBE_SUCCEEDED = "ProbeSucceeded"  # the probe's result was written to status
REASON_PROBE_FAILED = "ProbeFailed"  # image pull, OOM, timeout or garbage output
REASON_NODE_GONE = "NodeGone"  # the profiled node disappeared; the profile is stale
REASON_OVERRIDDEN = "Overridden"  # spec.override values win over measurements
REASON_PLANNED = "Planned"  # the planner produced gears
REASON_PLAN_FAILED = "PlanFailed"  # no feasible gear for the model on the fleet
REASON_RECONCILED = "Reconciled"  # owned objects match the spec
REASON_PLACEMENT_FAILED = "PlacementFailed"  # no node has the class or free GPUs a stage needs
REASON_NODE_LOST = "NodeLost"  # a node under a running stage disappeared
REASON_SIGNALS_MISSING = "SignalsMissing"  # Prometheus unreachable or a series absent
REASON_SCALED_UP = "ScaledUp"  # pipeline replicas raised
REASON_SCALED_DOWN = "ScaledDown"  # pipeline replicas lowered after a drain
REASON_WINDOW_CLOSING = "WindowClosing"  # work leaves a time-limited node before its deadline
REASON_WINDOWED_IN_USE = "WindowedInUse"  # a planned gear places work on a time-limited node
REASON_WINDOW_VACATED = "WindowVacated"  # nothing of the service is left on a time-limited node
REASON_WINDOW_NO_TARGET = "WindowNoTarget"  # no healthy gear off the closing node(s) to shift to
REASON_INVALID_SPEC = "InvalidSpec"  # the spec failed validation in the operator
REASON_PAUSED = "Paused"  # spec.paused stops gear shifting
REASON_FIELDS_PRUNED = "FieldsPruned"  # the API server dropped status fields its (older) CRD lacks
REASON_CRD_OUTDATED = "CRDOutdated"  # the CRD was replaced under the operator by one lacking its fields
REASON_CRD_UP_TO_DATE = "CRDUpToDate"  # the installed CRD holds every field the operator writes (again)


class Condition(StatusModel):
    """One status condition (Kubernetes ``metav1.Condition``)."""

    model_config = ConfigDict(frozen=True)

    type: str = Field(
        max_length=316, description="Condition type, CamelCase (Ready, Placed, Progressing, Degraded, ...)."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        default="",
        max_length=1024,
        description="CamelCase reason of the last transition or update, for machines.",
    )
    message: Message = Field(default="", description="Human-readable details.")
    last_transition_time: AwareDatetime | None = Field(
        default=None, description="When status last changed (RFC 3339); unchanged by reason/message edits."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was computed from."
    )


def find_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of ``type_``, or None."""
    return next((c for c in conditions if c.type == type_), None)


@dataclass(frozen=True)
class ConditionUpdate:
    """One condition a handler is to set (:func:`set_condition`'s arguments), decided by pure code:
    ``type``, ``status``, ``reason``, ``message``; ``warning``: its event is a Warning."""

    type: str
    status: ConditionStatus
    reason: str
    message: str
    warning: bool = False


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    now: datetime,
    observed_generation: int | None = None,
) -> tuple[list[Condition], bool]:
    """Set the condition ``type_`` and return ``(new list, changed)``.

    ``lastTransitionTime`` becomes ``now`` only when the condition is new or its status flips; a new
    reason, message or observed generation is recorded without touching it (the API conventions, and the
    fix of the older LWS setter that reset it on every generation). ``changed`` is True when status,
    reason or message differ, i.e. when an event is worth emitting; a bare generation bump is not.
    The input is not modified; the order of other conditions is kept.

    Raises:
        ValueError: ``status`` not ``True``/``False``/``Unknown`` or ``reason`` empty.
    """
    if status not in ("True", "False", "Unknown"):
        raise ValueError(f"condition status must be True, False or Unknown, got {status!r}")
    if not reason:
        raise ValueError(f"condition {type_!r} needs a CamelCase reason")
    old = find_condition(conditions, type_)
    kept = old is not None and old.status == status and old.last_transition_time is not None
    transition = old.last_transition_time if kept and old is not None else now
    # Bounded here too, not only by the model: ``changed`` compares against the stored (bounded) message,
    # so an over-long message would otherwise count as changed and emit an event on every reconcile.
    message = bounded(message)
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=transition,
        observed_generation=observed_generation,
    )
    changed = old is None or (old.status, old.reason, old.message) != (status, reason, message)
    if old is None:
        return [*conditions, new], changed
    return [new if c.type == type_ else c for c in conditions], changed


def condition_is_true(conditions: Sequence[Condition], type_: str) -> bool:
    """Whether the condition ``type_`` exists with status True."""
    cond = find_condition(conditions, type_)
    return cond is not None and cond.status == "True"


# --- errors ---------------------------------------------------------------------------------------
class SpecError(ValueError):
    """A custom resource that fails validation; the message names each bad field and what to do."""


def parse(model: type[M], data: Any, prefix: str = "") -> M:
    """Validate ``data`` (a kopf body or one of its parts) as ``model``.

    Raises:
        SpecError: one line per bad field, ``<prefix>.<path>: <message>`` (see
            :func:`format_validation_error`); handlers turn it into an ``InvalidSpec`` condition.
    """
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, prefix)) from exc


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per error, ``<path>: <message>`` with the path in camelCase as users write it.

    ``prefix`` (e.g. ``spec``) is put before every path. The returned text is what handlers put in an
    ``InvalidSpec`` condition and event.
    """
    lines = []
    for err in exc.errors():
        parts: list[str] = [prefix] if prefix else []
        for loc in err["loc"]:
            if isinstance(loc, int):
                parts[-1:] = [f"{parts[-1]}[{loc}]"] if parts else [f"[{loc}]"]
            elif not str(loc).startswith(("function-", "literal[", "constrained-")):
                parts.append(str(loc))
        path = ".".join(parts) or "(object)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)
