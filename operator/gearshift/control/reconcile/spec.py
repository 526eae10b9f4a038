"""The checks of a PDService's spec and its GearSets before anything is planned or applied: each GearSet
against its role (:func:`role_state`), the explicit gears against the model's layers and the engine's stage
limit; and which PDServices refer to a GearSet.

Raises :class:`~gearshift.control.reconcile.state.SpecInvalid` where the spec cannot be used as written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from gearshift.api.common import format_validation_error
from gearshift.api.gearset import GearSet
from gearshift.api.pdservice import ROLE_SECTIONS, PDService
from gearshift.control.reconcile.state import RoleState, SpecInvalid
from gearshift.planner.inputs import engine_stage_limit, stage_limit_problems


def role_state(pds: PDService, service: str, role: str, gs_body: dict[str, Any]) -> RoleState:
    """The :class:`RoleState` of ``role`` of PDService ``service`` from the body of the GearSet its
    ``gearSetRef`` names.

    Raises:
        SpecInvalid: the GearSet does not validate, or serves another service or role.
    """
    section = pds.spec.role_spec(role)
    ref = section.gear_set_ref.name
    try:
        gs = GearSet.model_validate(gs_body)
    except ValidationError as exc:
        raise SpecInvalid(f"GearSet {ref!r} is invalid:\n{format_validation_error(exc)}") from None
    if gs.spec.role != role or gs.spec.service_name != service:
        raise SpecInvalid(
            f"{ROLE_SECTIONS[role]}.gearSetRef names GearSet {ref!r}, which serves service "
            f"{gs.spec.service_name!r} role {gs.spec.role!r}; set its spec.serviceName: {service} and "
            f"spec.role: {role}, or refer to another GearSet"
        )
    return RoleState(role, gs_body, gs, autoscaled=section.scaling is not None)


def explicit_layer_problems(pds: PDService, roles: Mapping[str, RoleState]) -> None:
    """Check that every explicit gear covers exactly the model's layers, before anything is applied.

    The CRD can check that stages are contiguous but not the model's layer count (the GearSet does not
    know the model), so a gear ending at layer 40 of a 32-layer model would otherwise reach the pods and
    crash-loop there.

    Raises:
        SpecInvalid: naming the GearSet, the gear, where its stages end and the model's layer count.
    """
    layers = pds.spec.model.to_model_arch().num_layers
    problems = []
    for role, rs in roles.items():
        if rs.gs.spec.mode != "explicit":
            continue
        for gear in rs.gs.spec.gears:
            try:
                gear.check_model_layers(layers)
            except ValueError as exc:
                problems.append(f"{role}: GearSet {rs.gs.metadata['name']!r}: {exc}")
    if problems:
        raise SpecInvalid("; ".join(problems))


def explicit_engine_problems(
    pds: PDService, roles: Mapping[str, RoleState], profiles: Mapping[str, Mapping[str, Any]] | None = None
) -> None:
    """Check that every explicit gear has no more stages than the engine runs for its role (vLLM's
    decode: one, :func:`gearshift.planner.inputs.engine_stage_limit`), before anything is applied.

    Raises:
        SpecInvalid: naming the role, the GearSet, the gear, its stage count, why and what to write
            instead (and, from ``profiles``, when no node the gear names holds the whole model).
    """
    arch = pds.spec.model.to_model_arch()
    problems = []
    for role, rs in roles.items():
        limit = engine_stage_limit(pds.spec.engine, role)
        if rs.gs.spec.mode != "explicit" or limit is None:
            continue
        for msg in stage_limit_problems(rs.gs.spec.gears, limit, arch, profiles):
            problems.append(f"{role}: GearSet {rs.gs.metadata['name']!r}: {msg}")
    if problems:
        raise SpecInvalid("; ".join(problems))


def services_using(bodies: Iterable[Mapping[str, Any]], gearset: str) -> list[str]:
    """Names of the PDServices among ``bodies`` whose prefill, decode or serving refers to GearSet
    ``gearset``."""
    out = []
    for b in bodies:
        spec = b.get("spec") or {}
        refs = {(spec.get(r) or {}).get("gearSetRef", {}).get("name") for r in ROLE_SECTIONS.values()}
        if gearset in refs:
            out.append(b["metadata"]["name"])
    return sorted(out)
