"""A failed head restarts its whole pipeline replica (vLLM multi-node pipeline parallelism).

In vLLM's multi-node pipeline parallelism without Ray (``--nnodes/--node-rank/--master-addr``, ranks > 0
``--headless``: ``vllm/entrypoints/cli/serve.py`` ``run_headless``), the ranks of one pipeline rendezvous
with the head once, at start-up. When the head dies, a headless rank that had joined it hangs forever, and
the restarted head waits for ranks that never reconnect: the pipeline replica never serves again by itself.
gearshift follows LeaderWorkerSet's ``RecreateGroupOnPodRestart`` restart policy (sigs.k8s.io/lws,
``spec.leaderWorkerTemplate.restartPolicy``, its default: "When any pod in a group fails, the entire group
is recreated", site/content/en/docs/concepts/failure-handling; LWS detects a restart as a container
``restartCount > 0``, pkg/utils/pod ``ContainerRestarted``): when the head pod (``gearshift.io/stage: "0"``)
of pipeline replica r of a gear restarts -- its engine container's ``restartCount`` grows, or the pod is
recreated with a new UID -- the pods of ordinal r of the gear's other stage StatefulSets are deleted, so
the StatefulSet controller recreates them and they rendezvous with the new head. Only the head is
watched: a headless rank that fails breaks the head's collectives, the head's engine exits, and its
restart recreates the rest.

:func:`decide` is the pure decision; :func:`head_pod_event` is the thin kopf handler (pods labelled
``app.kubernetes.io/managed-by: gearshift``, ``app.kubernetes.io/component: engine`` and
``gearshift.io/stage: "0"`` whose ``engine`` container runs ``vllm`` with ``--nnodes`` > 1, as
:func:`gearshift.k8s.engine.vllm_container` builds a multi-stage gear's pods; the simulated engine's
stages do not rendezvous, so its pods are left alone). What was acted on is remembered in the head pod's
annotation :data:`ANNOTATION_RESTARTS_ACTED` (``<uid>:<restartCount>``), so an operator restart does not
act again; a stage pod created after the head's engine stopped is not stale, which keeps the decision
idempotent even when the operator stops between deleting pods and writing the annotation.

**KV epochs.** A PD role's engines are NIXL peers that know each other by engine id, and a peer that comes
back under its old id is never handshaken again (``gearshift.k8s.engine.kv_transfer_config``). The ranks of a
multi-stage PD gear share one id, the head pod's name and the replica's *KV epoch*: their pods start under the
scheduling gate :data:`~gearshift.k8s.engine.KV_EPOCH_GATE`; :func:`kv_epoch` gives the head a new epoch (its
UID) and each other rank the epoch of its head, and :func:`gated_pod_event` writes it as the annotation the
engine reads and lifts the gate. A restarted head of such a gear is deleted with its ranks
(:func:`act`), so the replica comes back as new pods under a new epoch instead of the old id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import PurePosixPath
from typing import Any

import kopf

from gearshift.adapters.kube import PDS, POD, KubeApi, KubeApiError
from gearshift.facts.rfc3339 import from_rfc3339
from gearshift.handlers.common import emit
from gearshift.handlers.runtime import runtime_of
from gearshift.k8s import names
from gearshift.k8s.engine import KV_EPOCH_ANNOTATION, KV_EPOCH_ENV, KV_EPOCH_GATE

log = logging.getLogger(__name__)

#: On a head pod: ``<pod uid>:<engine restartCount>`` of the last head restart acted on.
ANNOTATION_RESTARTS_ACTED = f"{names.DOMAIN}/restarts-acted"
#: The event reason on the PDService.
REASON_PIPELINE_REPLICA_RESTARTED = "PipelineReplicaRestarted"
#: The engine container's name in a stage pod (gearshift.k8s.engine's vllm_container and sim_container).
ENGINE_CONTAINER = "engine"
#: The StatefulSet controller's ordinal label (PodIndexLabel, Kubernetes >= 1.28; GA in 1.32).
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
#: A recreated head's stage pods created up to this long before it count as fresh, s: the ranks of one
#: pipeline replica are created by separate StatefulSets, a second or so apart, when a gear first starts
#: or rolls; a rank that had joined the previous head has run far longer (vLLM loads weights for minutes).
RECREATE_SLACK_S = 30.0


@dataclass(frozen=True)
class HeadState:
    """What the head pod of one pipeline replica shows now."""

    name: str
    uid: str
    ordinal: int
    created: datetime
    """The pod's ``metadata.creationTimestamp``."""
    restart_count: int
    """The engine container's ``restartCount``."""
    stopped_at: datetime | None = None
    """When the engine's previous instance stopped (``lastState.terminated.finishedAt``), if known."""
    acted: str | None = None
    """The :data:`ANNOTATION_RESTARTS_ACTED` value, if any."""


@dataclass(frozen=True)
class StagePod:
    """One pod of a stage StatefulSet of the same gear."""

    name: str
    stage: int
    ordinal: int
    created: datetime
    deleting: bool = False
    """``metadata.deletionTimestamp`` is set (already going)."""


@dataclass(frozen=True)
class Decision:
    """What to do about one head pod."""

    delete: tuple[str, ...] = ()
    """Stage pods of the head's ordinal to delete (sorted by stage)."""
    record: str | None = None
    """New :data:`ANNOTATION_RESTARTS_ACTED` value to write (None: leave it)."""
    cause: str = ""
    """``restarted`` (the engine container restarted) or ``recreated`` (a new head pod), or empty."""
    notes: list[str] = field(default_factory=list)


def acted_value(uid: str, restart_count: int) -> str:
    """The annotation value recording that ``restart_count`` of pod ``uid`` was acted on."""
    return f"{uid}:{restart_count}"


def parse_acted(raw: str | None) -> tuple[str, int] | None:
    """``(uid, restartCount)`` from an annotation value, or None when absent or malformed."""
    if not raw or ":" not in raw:
        return None
    uid, _, count = raw.rpartition(":")
    try:
        return (uid, int(count)) if uid else None
    except ValueError:
        return None


def decide(head: HeadState, pods: Sequence[StagePod], slack_s: float = RECREATE_SLACK_S) -> Decision:
    """Which stage pods of the head's pipeline replica to delete, and what to remember. Pure.

    - Already acted on: the annotation names this pod's UID with a restart count ≥ the observed one →
      nothing.
    - The engine container restarted (observed ``restartCount`` above the recorded one for this UID, or
      above 0 for a pod without a record): the stage pods k > 0 of the same ordinal created before the
      engine's previous instance stopped (``stopped_at``; unknown: all of them) are deleted.
    - A head pod with no record for its UID and no restart: a new head (recreated, or first start). Stage
      pods created more than ``slack_s`` before it predate it and had joined the head it replaced; they
      are deleted. At a gear's first start they are its age, so nothing is deleted.

    Stage pods already being deleted are skipped. The record is the observed ``<uid>:<restartCount>``
    whenever the head has stage pods beside it (a one-stage gear has none: nothing to remember).
    """
    peers = [p for p in pods if p.stage > 0 and p.ordinal == head.ordinal]
    if not peers:
        return Decision()
    seen = parse_acted(head.acted)
    base = seen[1] if seen is not None and seen[0] == head.uid else None
    if base is not None and head.restart_count <= base:
        return Decision()
    record = acted_value(head.uid, head.restart_count)
    if head.restart_count > (base or 0):
        cause = "restarted"
        cutoff = head.stopped_at
    else:
        cause = "recreated"
        cutoff = head.created - timedelta(seconds=slack_s)
    stale = [p for p in peers if not p.deleting and (cutoff is None or p.created < cutoff)]
    stale.sort(key=lambda p: (p.stage, p.name))
    return Decision(tuple(p.name for p in stale), record, cause if stale else "")


# --- reading pods (API JSON) -------------------------------------------------------------------------


def _time(raw: Any) -> datetime | None:
    if isinstance(raw, datetime):
        return raw
    if not raw:
        return None
    try:
        return from_rfc3339(str(raw))
    except ValueError:
        return None


def pod_ordinal(pod: Mapping[str, Any]) -> int | None:
    """The StatefulSet ordinal of a pod: its ``apps.kubernetes.io/pod-index`` label, else its name's
    ``-<n>`` suffix (``<statefulset>-<ordinal>``); None when neither is an integer."""
    meta = pod.get("metadata") or {}
    raw = (meta.get("labels") or {}).get(POD_INDEX_LABEL)
    if raw is None:
        raw = str(meta.get("name", "")).rpartition("-")[2]
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def engine_container(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod spec's ``engine`` container, or None."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == ENGINE_CONTAINER:
            return dict(c)
    return None


def _flag(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return str(args[i + 1])
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def vllm_ranks(pod: Mapping[str, Any]) -> int:
    """Ranks of the pod's vLLM pipeline: ``--nnodes`` of an ``engine`` container whose program is ``vllm``
    (gearshift.k8s.engine.vllm_args writes ``--nnodes K`` for a K-stage gear), 1 for a one-stage vLLM
    gear, 0 for any other engine (the simulated engine runs ``gearshift-sim``)."""
    c = engine_container(pod)
    command = list((c or {}).get("command") or [])
    if not command or PurePosixPath(str(command[0])).name != "vllm":
        return 0
    raw = _flag([str(a) for a in [*command[1:], *(c or {}).get("args", [])]], "--nnodes")
    try:
        return max(int(raw), 1) if raw is not None else 1
    except ValueError:
        return 1


def head_state(pod: Mapping[str, Any]) -> HeadState | None:
    """The :class:`HeadState` of a head pod, or None when it has no ordinal, UID or creation time."""
    meta = pod.get("metadata") or {}
    ordinal = pod_ordinal(pod)
    created = _time(meta.get("creationTimestamp"))
    if ordinal is None or created is None or not meta.get("uid"):
        return None
    restarts, stopped = 0, None
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == ENGINE_CONTAINER:
            restarts = int(cs.get("restartCount") or 0)
            stopped = _time(((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
    return HeadState(
        name=str(meta["name"]),
        uid=str(meta["uid"]),
        ordinal=ordinal,
        created=created,
        restart_count=restarts,
        stopped_at=stopped,
        acted=(meta.get("annotations") or {}).get(ANNOTATION_RESTARTS_ACTED),
    )


def stage_pods(pods: Sequence[Mapping[str, Any]]) -> list[StagePod]:
    """The :class:`StagePod` view of a gear's pods (those without a stage label, ordinal or creation time
    are left out)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ordinal = pod_ordinal(pod)
        created = _time(meta.get("creationTimestamp"))
        try:
            stage = int((meta.get("labels") or {}).get(names.LABEL_STAGE, ""))
        except ValueError:
            continue
        if ordinal is None or created is None:
            continue
        deleting = bool(meta.get("deletionTimestamp"))
        out.append(StagePod(str(meta["name"]), stage, ordinal, created, deleting))
    return out


def gated(pod: Mapping[str, Any]) -> bool:
    """The pod waits under :data:`KV_EPOCH_GATE`."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == KV_EPOCH_GATE for g in gates)


def epoch_kind(pod: Mapping[str, Any]) -> bool:
    """The pod's engine reads a KV epoch (its container has :data:`KV_EPOCH_ENV`): a multi-stage PD gear."""
    c = engine_container(pod) or {}
    return any(e.get("name") == KV_EPOCH_ENV for e in c.get("env") or [])


def kv_epoch(pod: Mapping[str, Any], head: Mapping[str, Any] | None) -> str | None:
    """The KV epoch to give a gated pod, or None to wait. Pure.

    A head (stage 0) starts a new incarnation of its pipeline replica: its own UID (the first 12 hex digits;
    a new pod, so a new value). Any other rank takes its head's epoch once the head has one and is not being
    deleted; until then it waits (the head's own gate lifting lifts it, :func:`gated_pod_event`).
    """
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get(names.LABEL_STAGE) == "0":
        uid = str(meta.get("uid") or "").replace("-", "")
        return uid[:12] or None
    if head is None or (head.get("metadata") or {}).get("deletionTimestamp") or gated(head):
        return None
    epoch = ((head.get("metadata") or {}).get("annotations") or {}).get(KV_EPOCH_ANNOTATION)
    return str(epoch) if epoch else None


def ungate_patch(pod: Mapping[str, Any], epoch: str) -> dict[str, Any]:
    """The merge patch that writes ``epoch`` and lifts :data:`KV_EPOCH_GATE` (other gates stay)."""
    gates = [
        g for g in (pod.get("spec") or {}).get("schedulingGates") or [] if g.get("name") != KV_EPOCH_GATE
    ]
    return {"metadata": {"annotations": {KV_EPOCH_ANNOTATION: epoch}}, "spec": {"schedulingGates": gates}}


def head_name_of(pod: Mapping[str, Any]) -> str | None:
    """The name of the head pod of ``pod``'s pipeline replica (stage 0, same ordinal), or None."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    ordinal = pod_ordinal(pod)
    service, role, gear = (labels.get(k) for k in (names.LABEL_SERVICE, names.LABEL_ROLE, names.LABEL_GEAR))
    if ordinal is None or not (service and role and gear):
        return None
    return f"{names.stage_statefulset_name(service, role, gear, 0)}-{ordinal}"


def release(api: KubeApi, pod: Mapping[str, Any]) -> str | None:
    """Give a gated pod its KV epoch and lift its gate; for a head, also its gated ranks. Returns the epoch
    written, or None (waiting for its head).

    Raises:
        KubeApiError: the API server refused a read or the patch.
    """
    meta = pod.get("metadata") or {}
    ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    is_head = (meta.get("labels") or {}).get(names.LABEL_STAGE) == "0"
    head_name = head_name_of(pod)
    head = None if is_head or head_name is None else api.get(*POD, ns, head_name)
    epoch = kv_epoch(pod, head)
    if epoch is None:
        return None
    api.patch(*POD, ns, name, ungate_patch(pod, epoch))
    if is_head:
        labels = meta.get("labels") or {}
        service, role, gear = (
            labels.get(k) for k in (names.LABEL_SERVICE, names.LABEL_ROLE, names.LABEL_GEAR)
        )
        ordinal = pod_ordinal(pod)
        if service and role and gear:
            for peer in api.list(*POD, ns, names.engine_labels(service, role, gear)):
                peer_name = str((peer.get("metadata") or {}).get("name") or "")
                if pod_ordinal(peer) == ordinal and gated(peer) and peer_name != name:
                    api.patch(*POD, ns, peer_name, ungate_patch(peer, epoch))
    return epoch


def event_message(head: HeadState, decision: Decision) -> str:
    """The PDService event's text."""
    if decision.cause == "restarted":
        what = f"head {head.name} restarted (restartCount {head.restart_count})"
    else:
        what = f"head {head.name} was recreated (uid {head.uid})"
    return f"{what}; recreating {', '.join(decision.delete)}"


def act(api: KubeApi, pod: Mapping[str, Any]) -> Decision:
    """Decide about one head pod and carry it out: delete the stale stage pods, record what was acted
    on in the head pod's annotation, and record a ``PipelineReplicaRestarted`` event on the PDService.

    Raises:
        KubeApiError: the API server refused a list, delete or patch (kopf retries the handler).
    """
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    ns = str(meta.get("namespace") or "")
    head = head_state(pod)
    service, role, gear = (labels.get(k) for k in (names.LABEL_SERVICE, names.LABEL_ROLE, names.LABEL_GEAR))
    if head is None or not (ns and service and role and gear):
        return Decision()
    if meta.get("deletionTimestamp") or vllm_ranks(pod) < 2:
        return Decision()
    seen = parse_acted(head.acted)
    if seen is not None and seen[0] == head.uid and head.restart_count <= seen[1]:
        return Decision()  # the common case: no API call
    gear_pods = api.list(*POD, ns, names.engine_labels(service, role, gear))
    decision = decide(head, stage_pods(gear_pods))
    for name in decision.delete:
        api.delete(*POD, ns, name)
    if decision.cause == "restarted" and epoch_kind(pod):
        # Restarted in place, the head would come back under its old engine id, which its NIXL peers
        # never handshake again: the whole replica comes back as new pods under a new KV epoch.
        api.delete(*POD, ns, head.name)
        decision = Decision((*decision.delete, head.name), None, decision.cause, decision.notes)
    elif decision.record is not None:
        api.patch(
            *POD, ns, head.name, {"metadata": {"annotations": {ANNOTATION_RESTARTS_ACTED: decision.record}}}
        )
    if decision.delete:
        body = api.get(*PDS, ns, service)
        msg = event_message(head, decision)
        if body is not None:
            emit(api, body, REASON_PIPELINE_REPLICA_RESTARTED, msg, warning=True)
        else:
            log.warning("%s/%s: %s (PDService %s not found)", ns, head.name, msg, service)
    return decision


@kopf.on.event(
    "",
    "v1",
    "pods",
    labels={
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.LABEL_COMPONENT: names.COMPONENT_ENGINE,
        names.LABEL_STAGE: "0",
    },
)
def head_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A head pod changed: recreate its pipeline replica's other ranks when it restarted (see :func:`act`).

    kopf does not retry event handlers; a refused call is logged and the head pod's next change (a
    restarting container changes its status several times: terminated, waiting, running, ready) tries
    again, since nothing is recorded until the deletes went through.
    """
    _on_pod(type, body, memo, act, "head pod")


@kopf.on.event(
    "",
    "v1",
    "pods",
    labels={names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_COMPONENT: names.COMPONENT_ENGINE},
    when=lambda body, **_: gated(body),
)
def gated_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A stage pod waits under the KV-epoch gate: give it its epoch and let it be scheduled (:func:`release`).

    A rank whose head has no epoch yet waits; the head's own release lifts it. A refused call is logged;
    the pod's next change, or its head's, tries again.
    """
    _on_pod(type, body, memo, release, "gated pod")


def _on_pod(
    type: str | None, body: kopf.Body, memo: kopf.Memo, do: Callable[[KubeApi, kopf.Body], object], what: str
) -> None:
    """Run ``do`` on a pod event through the runtime's API; a deletion is ignored, a refused call logged
    (kopf does not retry event handlers)."""
    if type == "DELETED":
        return
    try:
        do(runtime_of(memo).api, body)
    except KubeApiError as exc:
        meta = body.get("metadata") or {}
        log.warning("%s %s/%s: %s", what, meta.get("namespace"), meta.get("name"), exc)
