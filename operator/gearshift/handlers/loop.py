"""The operator's periodic kopf handlers, built in one place: the per-GearSet sampling daemons (the
gear-shifting loop, the autoscaler, the adaptive batch) by :func:`sampling_daemon`, the per-object step
timers (the GPUProfiles') by :func:`step_timer`.

The GearSet loops are kopf daemons rather than timers: a timer's interval is fixed when it is registered,
while ``spec.policy.sampleIntervalS`` is per object and may be edited (:func:`every_sample_interval`
re-reads it every turn). A GPUProfile's step runs at a fixed interval, so a timer serves it. Each factory
registers its handler with kopf when called (a handler module calls it at import, so ``--disable`` of the
module keeps it off) under the id it is given, and returns the function for tests to call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from concurrent.futures import Executor
from typing import Any

import kopf
from pydantic import ValidationError

from gearshift.adapters import metrics
from gearshift.adapters.kube import GS, PDS, KubeApi, KubeApiError
from gearshift.api.common import GROUP, VERSION
from gearshift.api.gearset import GearSet
from gearshift.api.pdservice import ROLE_SECTIONS, PDService
from gearshift.handlers.common import StatusPruned
from gearshift.handlers.reconcile import NotYet
from gearshift.handlers.runtime import Runtime, runtime_of

log = logging.getLogger("gearshift.loop")


#: The sample interval when the GearSet's is missing or unreadable, s (the API's default,
#: docs/sources.md#shift-signals).
DEFAULT_INTERVAL_S = 2.0
#: Seconds between two turns while a tick reports ``idle`` (nothing configured for it to do: one gear,
#: no scaling section, scaled to zero, no Prometheus) and nothing of its service changed. Each turn reads
#: the API several times, so an idle loop sleeps until something it reads changes (:func:`idle_wake_key`:
#: a spec edit, the reconciler's plan, the PDService, its StatefulSets, Deployments or pods, as the
#: watches deliver them) and at least every 5 minutes, the status report period of an unchanged node
#: (KEP-589 "Efficient Node Heartbeats"; ``control.shifting.shift_status.STATUS_HEARTBEAT_S``).
IDLE_INTERVAL_S = 300.0
#: Seconds between two looks at the GearSet (kopf's live body, no API call) while a turn waits: a wait
#: ends early when the GearSet's wake key moves (:func:`spec_generation` by default), so a spec edit
#: during a long wait (an idle one above all) is acted on within this time.
WAKE_POLL_S = 1.0


def spec_generation(body: Mapping[str, Any]) -> Hashable:
    """The default wake key: ``metadata.generation``, which moves with every spec edit."""
    return (body.get("metadata") or {}).get("generation")


async def wait_or_wake(
    stopped: kopf.DaemonStopped,
    seconds: float,
    body: Mapping[str, Any],
    wake_on: Callable[[Mapping[str, Any]], Hashable],
    key: Hashable,
) -> None:
    """Wait ``seconds``, less when the daemon is stopped or ``wake_on(body)`` stops being ``key``
    (looked at every :data:`WAKE_POLL_S` s)."""
    deadline = time.monotonic() + seconds
    while not stopped and wake_on(body) == key:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await stopped.wait(min(left, WAKE_POLL_S))


def missed_samples(elapsed_s: float, interval_s: float) -> int:
    """Sample instants a turn of ``elapsed_s`` passed without a sample of their own, at one sample every
    ``interval_s`` (> 0): the turn started at instant 0, and the next starts at once when it overran, in
    place of the latest instant that passed; every earlier one that passed is missed.

    E.g. at 2 s: a 1.9 s turn misses none, a 2.5 s one none (the next sample is 0.5 s late), a 4.5 s one
    the instant at 2 s."""
    return max(0, math.floor(elapsed_s / interval_s) - 1)


def sample_interval(body: Mapping[str, Any], floor_s: float) -> float:
    """``spec.policy.sampleIntervalS`` of a GearSet body, s, at least ``floor_s`` (2 s when unreadable)."""
    raw = ((body.get("spec") or {}).get("policy") or {}).get("sampleIntervalS", DEFAULT_INTERVAL_S)
    try:
        return max(float(raw), floor_s)
    except (TypeError, ValueError):
        return DEFAULT_INTERVAL_S


async def every_sample_interval(
    namespace: str,
    name: str,
    body: Mapping[str, Any],
    stopped: kopf.DaemonStopped,
    tick: Callable[[str, str], Any],
    *,
    what: str,
    floor_s: float,
    expected: tuple[type[BaseException], ...],
    on_missed: Callable[[int], object] | None = None,
    wake_on: Callable[[Mapping[str, Any]], Hashable] = spec_generation,
    idle_wake_on: Callable[[Mapping[str, Any]], Hashable] | None = None,
    executor: Executor | None = None,
) -> None:
    """Run ``tick(namespace, name)`` in a thread of ``executor`` (None: asyncio's default; the API client
    is synchronous) once per sample interval.

    A tick that returns an object with a truthy ``skipped`` logs it at debug level; one with a truthy
    ``idle`` waits :data:`IDLE_INTERVAL_S` before the next turn; an ``expected`` error, and a status write
    an older CRD pruned or that was held for one (:class:`~gearshift.handlers.common.StatusPruned`, whose
    event and error line were already recorded), is one warning line; anything else is logged with its
    traceback; the loop goes on either way until kopf stops the daemon.
    The interval is re-read from ``body`` (kopf keeps it current) every round. A turn longer than the
    interval never goes by silently: the sample instants it missed (:func:`missed_samples`) are
    counted (``gearshift_operator_samples_missed_total``), logged as a warning and handed to
    ``on_missed`` (the shifting loop's next status shows the count: ``status.signals.missedSamples``).
    The wait before the next turn ends early when ``wake_on(body)`` moves from what it was when the turn
    began (:func:`wait_or_wake`: a spec edit by default); after an idle turn, when ``idle_wake_on(body)``
    does (``wake_on`` when None).
    """
    expected = (*expected, StatusPruned)
    while not stopped:
        start = time.monotonic()
        idle_wake = idle_wake_on or wake_on
        key, idle_key = wake_on(body), idle_wake(body)  # before the reads: a change during them wakes
        idle = False
        try:
            res = await asyncio.get_running_loop().run_in_executor(executor, tick, namespace, name)
            idle = bool(getattr(res, "idle", False))
            if getattr(res, "skipped", None):
                log.debug("GearSet %s/%s %s: %s", namespace, name, what, res.skipped)
        except expected as exc:
            log.warning("GearSet %s/%s: %s failed: %s", namespace, name, what, exc)
        except Exception:
            log.exception("GearSet %s/%s: %s failed", namespace, name, what)
        interval = max(sample_interval(body, floor_s), IDLE_INTERVAL_S if idle else 0.0)
        elapsed = time.monotonic() - start
        missed = missed_samples(elapsed, interval)
        if missed:
            metrics.SAMPLES_MISSED.labels(what).inc(missed)
            if on_missed is not None:
                on_missed(missed)
            log.warning(
                "GearSet %s/%s: %s took %.1f s at a %.1f s interval: %d sample(s) missed",
                namespace, name, what, elapsed, interval, missed,
            )  # fmt: skip
        wake, until = (idle_wake, idle_key) if idle else (wake_on, key)
        await wait_or_wake(stopped, max(0.0, interval - elapsed), body, wake, until)


def idle_wake_key(
    body: Mapping[str, Any], wake_on: Callable[[Mapping[str, Any]], Hashable], service_changes: int
) -> Hashable:
    """What ends an idle loop's wait when it moves: ``wake_on(body)``, what the reconciler writes in the
    GearSet's status (its plan's ``profilesHash`` and gear count, ``autoscaled``, ``selector``,
    ``windowedNodes``) and ``service_changes`` (``Runtime.changes``: the PDService and what it owns).
    The loops' own status fields are left out: an idle turn that wrote them would wake itself."""
    st = body.get("status") or {}
    planned = st.get("plannedGears")
    reconciled = (
        st.get("profilesHash"),
        len(planned) if isinstance(planned, list) else None,
        st.get("autoscaled"),
        st.get("selector"),
        str(st.get("windowedNodes")),
    )
    return (wake_on(body), reconciled, service_changes)


def load_gearset_and_service(
    api: KubeApi, namespace: str, name: str
) -> tuple[dict[str, Any], GearSet, PDService] | str:
    """The GearSet ``namespace/name`` (raw body and model) and the PDService whose role refers to it.

    Returns a reason to skip this turn instead when the GearSet is gone or being deleted, either object
    does not validate, the PDService is missing, or its role names another GearSet.

    Raises:
        KubeApiError: the API server refused a read.
    """
    gs_body = api.get(*GS, namespace, name)
    if gs_body is None or (gs_body.get("metadata") or {}).get("deletionTimestamp"):
        return "GearSet gone"
    try:
        gs = GearSet.model_validate(gs_body)
    except ValidationError as exc:
        return f"GearSet invalid: {exc.error_count()} error(s)"
    role, service = gs.spec.role, gs.spec.service_name
    pds_body = api.get(*PDS, namespace, service)
    if pds_body is None:
        return f"PDService {service!r} not found"
    try:
        pds = PDService.model_validate(pds_body)
    except ValidationError:
        return f"PDService {service!r} invalid"
    section = ROLE_SECTIONS[role]
    if role not in pds.spec.roles:
        return f"PDService {service!r} has no spec.{section} (it serves roles {', '.join(pds.spec.roles)})"
    if pds.spec.role_spec(role).gear_set_ref.name != name:
        return f"PDService {service!r} {section} refers to another GearSet"
    return gs_body, gs, pds


# --- the factories -------------------------------------------------------------------------------------
#: What a sampling tick may raise that is one warning line, not a traceback: a refused API call, something
#: referenced not there yet, a key missing from a body read while it changes.
TICK_ERRORS: tuple[type[BaseException], ...] = (KubeApiError, NotYet, KeyError)
#: Seconds kopf waits for a sampling daemon to return once stopped before it cancels it.
CANCELLATION_TIMEOUT_S = 10.0


def sampling_daemon(
    handler_id: str,
    run_tick: Callable[[Runtime, str, str], object],
    *,
    what: str,
    floor_s: float,
    when: Callable[..., bool],
    count_missed: bool = False,
    wake_on: Callable[[Mapping[str, Any]], Hashable] = spec_generation,
) -> Callable[..., Awaitable[None]]:
    """Register with kopf, and return, the daemon ``handler_id`` of every GearSet ``when`` accepts: every
    sample interval (``spec.policy.sampleIntervalS``, at least ``floor_s`` s), ``run_tick(rt, namespace,
    name)`` in a thread of the runtime's ``loop_pool`` with the :class:`~gearshift.handlers.runtime.Runtime`
    of kopf's ``memo``
    (:func:`every_sample_interval`; ``what`` names the tick in logs and in
    ``gearshift_operator_samples_missed_total``; :data:`TICK_ERRORS` are one warning line each).
    ``count_missed``: the sample instants a turn let pass also go to ``rt.gearsets`` (the shifting loop's
    ``status.signals.missedSamples``). A wait ends early when ``wake_on`` of the GearSet moves
    (:func:`wait_or_wake`). kopf stops the daemon when ``when`` stops accepting the GearSet, and
    cancels it :data:`CANCELLATION_TIMEOUT_S` s after.
    """

    async def daemon(
        namespace: str, name: str, body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any
    ) -> None:
        rt = runtime_of(memo)

        def idle_wake(b: Mapping[str, Any]) -> Hashable:
            service = str((b.get("spec") or {}).get("serviceName") or "")
            return idle_wake_key(b, wake_on, rt.changes.count((namespace, service)))

        await every_sample_interval(
            namespace,
            name,
            body,
            stopped,
            functools.partial(run_tick, rt),
            what=what,
            floor_s=floor_s,
            expected=TICK_ERRORS,
            on_missed=functools.partial(rt.gearsets.add_missed, (namespace, name)) if count_missed else None,
            wake_on=wake_on,
            idle_wake_on=idle_wake,
            executor=rt.loop_pool,
        )

    daemon.__name__ = daemon.__qualname__ = handler_id
    daemon.__doc__ = f"Every ``spec.policy.sampleIntervalS`` (at least {floor_s:g} s): one {what}."
    register = kopf.daemon(
        GROUP, VERSION, "gearsets", id=handler_id, cancellation_timeout=CANCELLATION_TIMEOUT_S, when=when
    )
    register(daemon)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
    return daemon


def step_timer(
    handler_id: str,
    plural: str,
    step: Callable[..., None],
    *,
    interval: float,
    when: Callable[..., bool],
    initial_delay: float | None = None,
) -> Callable[..., None]:
    """Register with kopf, and return, the timer ``handler_id`` of every object of ``plural`` (this API
    group) that ``when`` accepts: every ``interval`` s, after ``initial_delay`` s (None: at once),
    ``step(rt, **kwargs)`` in kopf's thread pool, with the :class:`~gearshift.handlers.runtime.Runtime` of
    kopf's ``memo`` and every other keyword kopf passes (``name``, ``body``, ``spec``, ``meta``, its
    indices, ``logger``, ...). kopf starts and stops the timer as ``when`` starts and stops accepting the
    object, and retries a step that raised at its own pace.
    """

    def timer(memo: kopf.Memo, **kwargs: Any) -> None:
        step(runtime_of(memo), **kwargs)

    timer.__name__ = timer.__qualname__ = handler_id
    timer.__doc__ = f"Every {interval:g} s: one step of the {plural[:-1]}."
    register = kopf.timer(
        GROUP, VERSION, plural, id=handler_id, interval=interval, initial_delay=initial_delay, when=when
    )
    register(timer)
    return timer
