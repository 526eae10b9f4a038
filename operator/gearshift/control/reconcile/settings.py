"""The operator-wide settings (from ``gearshift operator`` flags) that the reconciler, the handlers and
``gearshift render`` read. Pure data: below the handlers, so a tool renders with the operator's own."""

from __future__ import annotations

from dataclasses import dataclass, field

from gearshift.k8s.desired import Images

#: Requests per planner simulation run, unless ``--sim-requests`` says otherwise: bounds the planning
#: time per gear candidate.
SIM_REQUESTS = 500


@dataclass(frozen=True)
class Settings:
    """Operator-wide settings (from ``gearshift operator`` flags)."""

    images: Images = field(default_factory=Images)
    prometheus_url: str | None = None
    sim_requests: int = SIM_REQUESTS
    """Requests per planner simulation run (bounds planning time per gear candidate)."""
    namespaces: tuple[str, ...] = ()
    """The namespaces served (``--namespace``, globs as kopf allows them); empty: all."""
    profiles: bool = True
    """Whether this operator writes GPUProfiles (False under ``--disable gearshift.handlers.gpuprofile``)."""
