"""Everything the operator keeps in the cluster for one PDService, as a list of manifests. Pure.

Per role and running gear: the gear's headless Service and one StatefulSet per stage; per role: the
Service selecting the active gear's heads (left out while a shift is in flight: the gear executor then
owns its selector); once: the router's ServiceAccount, Role, RoleBinding, Deployment, and the client
Service ``<pds>``. Everything carries an owner reference to the PDService, so the garbage collector
deletes it with the PDService.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.api.common import inputs_hash
from gearshift.api.gearset import Gear
from gearshift.api.pdservice import PDServiceSpec
from gearshift.facts.model import VLLM_GPU_MEMORY_UTILIZATION
from gearshift.k8s.engine import DEFAULT_SIM_IMAGE, DEFAULT_VLLM_IMAGE, EngineContext
from gearshift.k8s.router import build_router_deployment, build_router_rbac
from gearshift.k8s.services import build_client_service, build_gear_headless_service, build_role_service
from gearshift.k8s.statefulset import build_stage_statefulset


@dataclass(frozen=True)
class RoleDesire:
    """What to run for one role."""

    role: str
    gears: Sequence[Gear]
    """Gears whose pods should exist (the active one, plus both ends of a shift in flight)."""
    selected: str | None
    """Gear the role Service selects; None leaves the Service to the gear executor."""
    pipeline_replicas: int = 1
    drain_s: float = 120.0
    memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    links: Mapping[str, Sequence[dict[str, float]] | None] = field(default_factory=dict)
    """Per gear name, the simulated pipeline's links (None: engine defaults)."""


@dataclass(frozen=True)
class Images:
    """Default images when the PDService names none (the operator's flags)."""

    vllm: str = DEFAULT_VLLM_IMAGE
    sim: str = DEFAULT_SIM_IMAGE
    router: str | None = None


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """The controller owner reference to a PDService body (``blockOwnerDeletion`` for foreground deletes).

    Raises:
        KeyError: the body has no ``metadata.uid`` or ``metadata.name``.
    """
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", "gearshift.io/v1alpha1"),
        "kind": body.get("kind", "PDService"),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def engine_context(
    service: str, namespace: str, spec: PDServiceSpec, desire: RoleDesire, images: Images, gear: Gear
) -> EngineContext:
    """The :class:`EngineContext` of one role's gear (the vLLM-only fields from ``spec.engineArgs``,
    ``kvBufferDevice``, ``hfTokenSecret``, ``modelCache`` and ``resources``)."""
    image = spec.image or (images.sim if spec.engine == "sim" else images.vllm)
    secret = spec.hf_token_secret
    cache = spec.model_cache
    res = spec.resources
    return EngineContext(
        service=service,
        namespace=namespace,
        role=desire.role,
        engine=spec.engine,
        model=spec.model.to_model_arch(),
        served_model_name=spec.model.name,
        image=image,
        pipeline_replicas=desire.pipeline_replicas,
        drain_s=desire.drain_s,
        memory_utilization=desire.memory_utilization,
        links=desire.links.get(gear.name),
        dtype=spec.model.weights_dtype,
        kv_buffer_device=spec.kv_buffer_device,
        kv_lease_s=spec.kv_lease_s,
        engine_args=tuple(spec.engine_args),
        hf_token_secret=(secret.name, secret.key) if secret else None,
        model_cache_host_path=cache.host_path if cache else None,
        model_cache_claim=cache.claim_name if cache else None,
        cpu_request=res.cpu if res else None,
        memory_request=res.memory if res else None,
    )


def gear_objects(
    service: str,
    namespace: str,
    spec: PDServiceSpec,
    desire: RoleDesire,
    gear: Gear,
    images: Images,
    owner: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """The headless Service and the stage StatefulSets of one gear of one role.

    Raises:
        gearshift.k8s.engine.EngineSpecError: the engine cannot run the gear.
    """
    ctx = engine_context(service, namespace, spec, desire, images, gear)
    ghash = inputs_hash(gear.to_json())
    objs = [build_gear_headless_service(service, namespace, desire.role, gear.name, owner)]
    objs += [build_stage_statefulset(ctx, gear, k, owner, ghash) for k in range(len(gear.stages))]
    return objs


def desired_objects(
    service: str,
    namespace: str,
    spec: PDServiceSpec,
    roles: Sequence[RoleDesire],
    images: Images,
    owner: dict[str, Any] | None,
    prometheus_url: str | None = None,
) -> list[dict[str, Any]]:
    """All manifests of a PDService, in apply order (RBAC before the router that needs it).

    Raises:
        gearshift.k8s.engine.EngineSpecError: the engine cannot run one of the gears.
    """
    objs: list[dict[str, Any]] = []
    for desire in roles:
        for gear in desire.gears:
            objs += gear_objects(service, namespace, spec, desire, gear, images, owner)
        if desire.selected is not None:
            objs.append(build_role_service(service, namespace, desire.role, desire.selected, owner))
    objs += build_router_rbac(service, namespace, owner)
    objs.append(build_router_deployment(service, namespace, spec, images.router, owner, prometheus_url))
    objs.append(build_client_service(service, namespace, owner))
    return objs
