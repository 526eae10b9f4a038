"""The per-GearSet sampling loop that the gear-shift and the autoscale daemons both run.

A kopf daemon rather than a timer: a timer's interval is fixed when it is registered, while
``spec.policy.sampleIntervalS`` is per object and may be edited.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from gearshift.adapters import metrics
from gearshift.adapters.kube import GS, PDS, KubeApi
from gearshift.api.gearset import GearSet
from gearshift.api.pdservice import ROLE_SECTIONS, PDService
from gearshift.handlers.common import StatusPruned

log = logging.getLogger("gearshift.loop")


#: The sample interval when the GearSet's is missing or unreadable, s (the API's default, seed 002).
DEFAULT_INTERVAL_S = 2.0
#: Seconds between two turns while a tick reports ``idle`` (nothing configured for it to do: one gear,
#: no scaling section, scaled to zero). Each turn reads the API several times, and a namespace of idle
#: services would otherwise keep the operator busy (issue 6: no hot loop when idle); enabling the
#: feature takes effect within this time.
IDLE_INTERVAL_S = 30.0


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
) -> None:
    """Run ``tick(namespace, name)`` in a thread (the API client is synchronous) once per sample interval.

    A tick that returns an object with a truthy ``skipped`` logs it at debug level; one with a truthy
    ``idle`` waits :data:`IDLE_INTERVAL_S` before the next turn; an ``expected`` error, and a status write
    an older CRD pruned or that was held for one (:class:`~gearshift.handlers.common.StatusPruned`, whose
    event and error line were already recorded), is one warning line; anything else is logged with its
    traceback; the loop goes on either way until kopf stops the daemon.
    The interval is re-read from ``body`` (kopf keeps it current) every round. A turn longer than the
    interval never goes by silently (#31): the sample instants it missed (:func:`missed_samples`) are
    counted (``gearshift_operator_samples_missed_total``), logged as a warning and handed to
    ``on_missed`` (the shifting loop's next status shows the count: ``status.signals.missedSamples``).
    """
    expected = (*expected, StatusPruned)
    while not stopped:
        start = time.monotonic()
        idle = False
        try:
            res = await asyncio.to_thread(tick, namespace, name)
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
        await stopped.wait(max(0.0, interval - elapsed))


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
