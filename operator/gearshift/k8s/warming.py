"""Warm-up traffic marks on a warming shadow's head pods (docs/sources.md#shift-executor: a shadow warms on
mirrored traffic). Pure.

While a shift is ``Warming`` the target gear's StatefulSets run beside the serving gear, outside the role
Service. The shifting loop marks their head pods (stage 0: the pods that serve HTTP) with the label
:data:`~gearshift.k8s.names.LABEL_WARMING` and the annotation
:data:`~gearshift.k8s.names.ANNOTATION_MIRROR_RPS` (:func:`mirror_rps`: the mirrored requests/s one
router replica may send that pod); the router finds them (gearshift.router.mirror) and mirrors a share of
live requests to them, answers dropped.

Why on the pods, patched, and not in the pod template: a template change rolls the StatefulSet, so a
mark in the template would restart the shadow's pods when it is removed at the switch (the shift then sees
its new gear "not Ready while draining" and rolls back), and the reconciler, which builds the same gear
without the mark, would roll them when it applies. A label patched onto a running pod restarts nothing and
the StatefulSet controller leaves extra labels alone; a pod recreated while the gear warms is marked again
on the next tick (the loop is level-triggered), and one recreated after the switch is born unmarked.
The router also never mirrors to a pod it already routes to (one the role Service selects), so the tick
between the switch and the unmarking mirrors nothing either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gearshift.api.gearset import Gear
from gearshift.k8s import names


def head_pods_per_pipeline(gear: Gear, engine: str) -> int:
    """Head pods one pipeline replica of ``gear`` runs: its stage 0's replicas (a hot head stage runs
    extras), or for vLLM, which cannot replicate one stage, one (as
    :func:`gearshift.k8s.statefulset.stage_replicas` counts them)."""
    if engine == "vllm":
        return max(1, min(s.replicas for s in gear.stages))
    return max(1, gear.stages[0].replicas)


def mirror_rps(
    warmup_share: float, predicted_rps: float | None, *, head_pods: int = 1, router_replicas: int = 1
) -> float:
    """Mirrored requests/s one router replica may send one warming head pod: ``warmup_share`` × the gear's
    predicted throughput (``predicted_rps``, requests/s of one pipeline replica) ÷ the ``head_pods`` of a
    pipeline replica ÷ the ``router_replicas`` (each mirrors on its own). Every head pod of the gear
    together takes at most ``warmup_share`` of what the gear is predicted to serve. 0 when the gear
    predicts no throughput: no capacity to take a share of, so no mirror. The one formula: the shifting
    loop's marks (:func:`gear_mirror_rps`) and the twin (gearshift.dev.twin.engines, one router that
    mirrors to a whole gear) both call it."""
    if not predicted_rps or predicted_rps <= 0 or warmup_share <= 0:
        return 0.0
    return warmup_share * predicted_rps / max(1, head_pods) / max(1, router_replicas)


def gear_mirror_rps(
    warmup_share: float, gear: Gear | None, engine: str = "sim", router_replicas: int = 1
) -> float:
    """:func:`mirror_rps` of a warming ``gear`` (None: no gear warms, 0): its ``predicted.throughputQps``
    over its :func:`head_pods_per_pipeline` under ``engine``."""
    if gear is None:
        return 0.0
    predicted = gear.predicted.throughput_qps if gear.predicted is not None else None
    return mirror_rps(
        warmup_share,
        predicted,
        head_pods=head_pods_per_pipeline(gear, engine),
        router_replicas=router_replicas,
    )


def _is_head(labels: Mapping[str, str]) -> bool:
    return (
        labels.get(names.LABEL_COMPONENT) == names.COMPONENT_ENGINE and labels.get(names.LABEL_STAGE) == "0"
    )


def warming_mark_patches(
    pods: Iterable[Mapping[str, Any]], warming_gear: str | None, mirror_rps: float
) -> list[tuple[str, dict[str, Any]]]:
    """The JSON merge patches that bring one role's ``pods`` to their warm-up marks, per pod name.

    The head pods of ``warming_gear`` (None: no gear warms) carry the label ``"true"`` and the annotation
    ``mirror_rps`` (:func:`gearshift.k8s.names.format_mirror_rps`); every other pod carries neither. Pods
    already as they should be, and pods being deleted, get no patch.
    """
    value = names.format_mirror_rps(mirror_rps)
    out: list[tuple[str, dict[str, Any]]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or not meta.get("name"):
            continue
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        want = warming_gear is not None and labels.get(names.LABEL_GEAR) == warming_gear and _is_head(labels)
        marked = (
            labels.get(names.LABEL_WARMING) == "true"
            and annotations.get(names.ANNOTATION_MIRROR_RPS) == value
        )
        stale = names.LABEL_WARMING in labels or names.ANNOTATION_MIRROR_RPS in annotations
        # A merge patch's null removes the key.
        label: str | None = "true" if want else None
        rps: str | None = value if want else None
        if (want and not marked) or (not want and stale):
            patch = {
                "metadata": {
                    "labels": {names.LABEL_WARMING: label},
                    "annotations": {names.ANNOTATION_MIRROR_RPS: rps},
                }
            }
            out.append((str(meta["name"]), patch))
    return out
