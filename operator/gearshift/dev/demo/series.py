"""Time series for the demo's live line and report, from measurements only (pure).

Three sources, each measured outside the simulated engines' internal state:

- the load generator's per-request wire records (:class:`gearshift.dev.loadgen.RequestRecord`), binned by
  send time into QPS and P99 TTFT/ITL (:func:`bin_wire`);
- the router's own ``/metrics`` (its counters and histograms, scraped by the demo): rates and
  histogram quantiles between two scrapes (:func:`router_window`), computed as Prometheus'
  ``rate`` and ``histogram_quantile`` would;
- Prometheus range queries (``/api/v1/query_range`` answers, :func:`matrix_series`).

Gear shifts come from the GearSets' ``status.history`` (:func:`shift_marks`). Times are seconds since
the run's start unless a name says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gearshift.facts.rfc3339 import from_rfc3339

# ------------------------------------------------------------------------------------ wire (loadgen)


@dataclass(frozen=True)
class WireRecord:
    """One request as the load generator measured it; times in s, ``sent_s`` since the run's start."""

    sent_s: float
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: tuple[float, ...] = ()


def wire_records(records: Iterable[Any], perf0: float) -> list[WireRecord]:
    """Convert ``gearshift.dev.loadgen.RequestRecord`` objects (``sent_at`` on ``time.perf_counter``) into
    :class:`WireRecord` with send times relative to ``perf0`` (the perf_counter at the run's start)."""
    out = []
    for r in records:
        out.append(
            WireRecord(
                sent_s=float(r.sent_at) - perf0,
                ok=bool(r.ok),
                ttft_s=r.ttft_s,
                e2e_s=r.e2e_s,
                itls_s=tuple(r.itls_s),
            )
        )
    return out


@dataclass
class Series:
    """A named time series: ``t`` (s since the run's start) and ``v`` (NaN where nothing was measured)."""

    name: str
    t: list[float] = field(default_factory=list)
    v: list[float] = field(default_factory=list)

    def finite(self) -> list[float]:
        """The measured values (NaNs dropped)."""
        return [x for x in self.v if not math.isnan(x)]


def _p99(values: Sequence[float]) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), 99)) if values else math.nan


def bin_wire(records: Sequence[WireRecord], bin_s: float, run_s: float) -> dict[str, Series]:
    """Per ``bin_s`` bin of a run of ``run_s`` s: ``sent_qps`` (requests sent/s), ``done_qps`` (requests
    finished OK/s, by finish time), ``ttft_p99_ms`` and ``itl_p99_ms`` (of requests sent in the bin).

    Bins with no measured request hold NaN latencies (a gap in a plot, not a zero).
    """
    if bin_s <= 0:
        raise ValueError("bin_s must be positive")
    n = max(1, math.ceil(run_s / bin_s))
    sent = [0] * n
    done = [0] * n
    ttft: list[list[float]] = [[] for _ in range(n)]
    itl: list[list[float]] = [[] for _ in range(n)]

    def index(t: float) -> int | None:
        k = int(t // bin_s)
        return k if 0 <= k < n else None

    for r in records:
        k = index(r.sent_s)
        if k is not None:
            sent[k] += 1
            if r.ok and r.ttft_s is not None:
                ttft[k].append(r.ttft_s * 1e3)
            if r.ok:
                itl[k].extend(x * 1e3 for x in r.itls_s)
        if r.ok and r.e2e_s is not None:
            kd = index(r.sent_s + r.e2e_s)
            if kd is not None:
                done[kd] += 1
    centres = [(k + 0.5) * bin_s for k in range(n)]
    return {
        "sent_qps": Series("sent_qps", centres, [c / bin_s for c in sent]),
        "done_qps": Series("done_qps", centres, [c / bin_s for c in done]),
        "ttft_p99_ms": Series("ttft_p99_ms", centres, [_p99(x) for x in ttft]),
        "itl_p99_ms": Series("itl_p99_ms", centres, [_p99(x) for x in itl]),
    }


def recent_wire(records: Sequence[WireRecord], now_s: float, window_s: float) -> dict[str, float]:
    """QPS (finished OK per s) and P99 TTFT/ITL (ms) of requests that finished in the last ``window_s``."""
    fin = [
        r for r in records if r.ok and r.e2e_s is not None and now_s - window_s <= r.sent_s + r.e2e_s <= now_s
    ]
    return {
        "qps": len(fin) / window_s if window_s > 0 else math.nan,
        "ttft_p99_ms": _p99([r.ttft_s * 1e3 for r in fin if r.ttft_s is not None]),
        "itl_p99_ms": _p99([x * 1e3 for r in fin for x in r.itls_s]),
    }


# ------------------------------------------------------------------------------ router's own metrics


@dataclass(frozen=True)
class RouterScrape:
    """What the demo keeps of one scrape of the router's ``/metrics``."""

    t: float
    """Seconds since the run's start."""
    ok: float
    """``gearshift_router_requests_total{outcome="ok"}`` summed over pods and policies."""
    total: float
    """``gearshift_router_requests_total`` summed over every outcome."""
    ttft: tuple[tuple[float, float], ...]
    """``gearshift_router_upstream_ttft_seconds_bucket``: (le, cumulative count), le ascending."""
    itl: tuple[tuple[float, float], ...]
    """``gearshift_router_upstream_itl_seconds_bucket``: (le, cumulative count), le ascending."""


def parse_router_metrics(text: str, t: float) -> RouterScrape:
    """Read the router's exposition text (``gearshift.router.metrics``) into a :class:`RouterScrape`."""
    from prometheus_client.parser import text_string_to_metric_families

    ok = total = 0.0
    buckets: dict[str, dict[float, float]] = {"ttft": {}, "itl": {}}
    names = {
        "gearshift_router_upstream_ttft_seconds_bucket": "ttft",
        "gearshift_router_upstream_itl_seconds_bucket": "itl",
    }
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "gearshift_router_requests_total":
                total += s.value
                if s.labels.get("outcome") == "ok":
                    ok += s.value
            elif s.name in names:
                le = float(s.labels["le"])
                b = buckets[names[s.name]]
                b[le] = b.get(le, 0.0) + s.value  # summed over policies
    return RouterScrape(
        t=t,
        ok=ok,
        total=total,
        ttft=tuple(sorted(buckets["ttft"].items())),
        itl=tuple(sorted(buckets["itl"].items())),
    )


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile``: ``buckets`` are (upper bound, cumulative count), ascending, the
    last one ``+Inf``. Linear interpolation inside the bucket; the lowest bucket starts at 0; a quantile in
    the ``+Inf`` bucket is the highest finite bound. NaN when the histogram is empty."""
    if not buckets:
        return math.nan
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def _delta(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(a)
    # A counter that went down means the router restarted: count from zero, as Prometheus' rate() does.
    return [(le, c - before.get(le, 0.0) if c >= before.get(le, 0.0) else c) for le, c in b]


def router_window(a: RouterScrape, b: RouterScrape) -> dict[str, float]:
    """QPS (OK answers/s), all requests/s and P99 TTFT/ITL (ms) between scrapes ``a`` and ``b``."""
    dt = b.t - a.t
    if dt <= 0:
        return {"qps": math.nan, "rps": math.nan, "ttft_p99_ms": math.nan, "itl_p99_ms": math.nan}
    ok = b.ok - a.ok if b.ok >= a.ok else b.ok
    tot = b.total - a.total if b.total >= a.total else b.total
    return {
        "qps": ok / dt,
        "rps": tot / dt,
        "ttft_p99_ms": histogram_quantile(0.99, _delta(a.ttft, b.ttft)) * 1e3,
        "itl_p99_ms": histogram_quantile(0.99, _delta(a.itl, b.itl)) * 1e3,
    }


def router_series(scrapes: Sequence[RouterScrape], window_s: float) -> dict[str, Series]:
    """Router QPS and P99 TTFT/ITL over sliding ``window_s`` windows ending at each scrape."""
    out = {k: Series(k) for k in ("qps", "ttft_p99_ms", "itl_p99_ms")}
    j = 0
    for b in scrapes:
        while j < len(scrapes) and scrapes[j].t < b.t - window_s - 1e-9:
            j += 1
        a = scrapes[j]
        if b.t - a.t <= 0:
            continue
        w = router_window(a, b)
        for k, s in out.items():
            s.t.append(b.t)
            s.v.append(w[k])
    return out


# ---------------------------------------------------------------------------------------- Prometheus


def matrix_series(result: Iterable[Mapping[str, Any]], t0: float, label: str | Sequence[str]) -> list[Series]:
    """Series from a Prometheus range query's ``data.result`` (``resultType: matrix``).

    Args:
        result: ``[{"metric": {...}, "values": [[unix_s, "value"], ...]}]``.
        t0: the run's start, Unix s (times become s since it).
        label: the label(s) naming each series (joined with ``/``).
    """
    keys = [label] if isinstance(label, str) else list(label)
    out = []
    for item in result:
        metric = item.get("metric") or {}
        name = "/".join(str(metric.get(k, "?")) for k in keys)
        s = Series(name)
        for ts, val in item.get("values") or []:
            s.t.append(float(ts) - t0)
            try:
                s.v.append(float(val))
            except ValueError:
                s.v.append(math.nan)
        out.append(s)
    out.sort(key=lambda s: s.name)
    return out


# ------------------------------------------------------------------------------------- gear shifts


@dataclass(frozen=True)
class ShiftMark:
    """One gear shift of one role, as its GearSet's ``status.history`` records it."""

    role: str
    from_gear: str | None
    to_gear: str
    trigger: str
    outcome: str
    started_s: float
    finished_s: float | None
    message: str = ""
    """The record's message (why a shift rolled back or failed)."""


def _ts(value: Any) -> float | None:
    if not value:
        return None
    return from_rfc3339(str(value)).timestamp()


def shift_marks(role: str, history: Iterable[Mapping[str, Any]], t0: float) -> list[ShiftMark]:
    """The shifts of ``history`` (GearSet ``status.history`` items) relative to the run start ``t0``
    (Unix s); shifts that finished before the run are left out (one still running at the start is kept,
    with a negative start)."""
    out = []
    for h in history:
        started = _ts(h.get("startedAt"))
        finished = _ts(h.get("finishedAt"))
        if started is None or (finished if finished is not None else started) < t0:
            continue
        out.append(
            ShiftMark(
                role=role,
                from_gear=h.get("from"),
                to_gear=str(h.get("to")),
                trigger=str(h.get("trigger", "")),
                outcome=str(h.get("outcome", "")),
                started_s=started - t0,
                finished_s=None if finished is None else finished - t0,
                message=str(h.get("message") or ""),
            )
        )
    return sorted(out, key=lambda m: m.started_s)


@dataclass(frozen=True)
class GearSpan:
    """An interval during which ``gear`` served ``role``'s traffic."""

    role: str
    gear: str
    start_s: float
    end_s: float


def gear_spans(role: str, first_gear: str, marks: Sequence[ShiftMark], run_s: float) -> list[GearSpan]:
    """Which gear served ``role`` when: ``first_gear`` from 0, then the target of every shift that
    succeeded, from the moment it finished (traffic moves at the switch, not when shadows start)."""
    spans = []
    gear, since = first_gear, 0.0
    for m in marks:
        if m.role != role or m.outcome != "Succeeded" or m.finished_s is None:
            continue
        at = min(max(m.finished_s, since), run_s)
        if m.to_gear != gear:
            spans.append(GearSpan(role, gear, since, at))
            gear, since = m.to_gear, at
    spans.append(GearSpan(role, gear, since, run_s))
    return [s for s in spans if s.end_s > s.start_s or len(spans) == 1]


def timeline(
    gearsets: Mapping[str, Mapping[str, Any]], first_gears: Mapping[str, str], t0: float, run_s: float
) -> tuple[list[ShiftMark], list[GearSpan]]:
    """The shifts of every role's GearSet (role → GearSet document, read at the run's end) from its
    ``status.history``, by start (s since ``t0``), and which gear served each role when (``first_gears``:
    role → the gear the run started on)."""
    marks: list[ShiftMark] = []
    spans: list[GearSpan] = []
    for role, gs in gearsets.items():
        m = shift_marks(role, (gs.get("status") or {}).get("history") or [], t0)
        marks += m
        spans += gear_spans(role, first_gears[role], m, run_s)
    marks.sort(key=lambda m: m.started_s)
    return marks, spans


def router_totals(scrapes: Sequence[RouterScrape]) -> dict[str, float]:
    """The router's own count of requests (all, and answered OK) and P99 TTFT and ITL, ms, between its
    first and last scrape of the run; empty with fewer than two scrapes."""
    if len(scrapes) < 2:
        return {}
    first, last = scrapes[0], scrapes[-1]
    w = router_window(first, last)
    return {
        "requests": last.total - first.total,
        "ok": last.ok - first.ok,
        "ttft_p99_ms": w["ttft_p99_ms"],
        "itl_p99_ms": w["itl_p99_ms"],
    }


def mean_values(by_role: Mapping[str, Sequence[Series]]) -> dict[str, dict[str, float]]:
    """Role → series name → the mean of its finite values (a series with none is left out)."""
    return {
        role: {s.name: sum(s.finite()) / len(s.finite()) for s in ss if s.finite()}
        for role, ss in by_role.items()
    }
