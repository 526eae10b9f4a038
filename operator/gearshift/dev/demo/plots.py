"""The demo report's PNG plots, drawn with matplotlib's Agg backend from plain data (no cluster access).

- :func:`plot_traffic`: QPS, P99 TTFT and P99 ITL over the run, wire and router measurements side by
  side, SLO lines, which gear each role ran (bands) and every gear shift (shaded from its start to its
  finish, labelled at its start, near labels staggered);
- :func:`plot_utilization`: per-stage utilisation of each role's gears (Prometheus), shifts marked;
- :func:`plot_placement`: the fleet (one row per GPU node: model, memory, measured score) and which stage
  of which gear each node hosts, with its layer range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: the demo may run without a display

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from gearshift.dev.demo.series import GearSpan, Series, ShiftMark

#: One colour per gear intent, used for bands, placement cells and legends alike.
GEAR_COLOURS = {"latency": "#4C72B0", "balanced": "#55A868", "throughput": "#C44E52"}
_EXTRA = ["#8172B2", "#CCB974", "#64B5CD", "#937860", "#DA8BC3"]
ROLE_STYLE = {"prefill": "--", "decode": ":"}


def gear_colour(gear: str) -> str:
    """A stable colour for a gear name (intent names get theirs; others a hashed one)."""
    return GEAR_COLOURS.get(gear) or _EXTRA[sum(map(ord, gear)) % len(_EXTRA)]


#: Shift label font size, points; :func:`label_width_s` estimates widths from it.
LABEL_FONT_PT = 7.0
#: Vertical distance between two label levels, points.
LABEL_STEP_PT = 10.0


def shift_interval(m: ShiftMark, run_s: float) -> tuple[float, float]:
    """When shift ``m`` was under way, s since the run's start: from its start (shadow pods created,
    warm-up, drain, switch) to its finish, or to the run's end (``run_s``) while still in progress."""
    end = m.finished_s if m.finished_s is not None else run_s
    return m.started_s, max(end, m.started_s)


def shift_label(m: ShiftMark) -> str:
    """``prefill: latency→throughput``, with the outcome when it is not ``Succeeded``."""
    txt = f"{m.role}: {m.from_gear or '?'}→{m.to_gear}"
    if m.finished_s is None or m.outcome in ("", "InProgress"):
        return txt + " (in progress)"
    return txt if m.outcome == "Succeeded" else f"{txt} ({m.outcome})"


def label_width_s(text: str, run_s: float, axes_width_in: float, font_pt: float = LABEL_FONT_PT) -> float:
    """A generous estimate of how many seconds of the x axis ``text`` covers: 0.62 em per character
    (DejaVu Sans averages about 0.55) plus two characters of padding, on axes ``axes_width_in`` inches
    wide spanning ``run_s`` s."""
    width_in = (len(text) + 2) * 0.62 * font_pt / 72.0
    return width_in * max(run_s, 1.0) / max(axes_width_in, 1e-6)


def stagger_levels(extents_s: Sequence[tuple[float, float]]) -> list[int]:
    """A level (0, 1, ...) per label so that labels on one level never overlap: each label, left to right,
    takes the lowest level whose previous label ends before it begins (``extents_s``: (left, right), s)."""
    order = sorted(range(len(extents_s)), key=lambda i: extents_s[i][0])
    ends: list[float] = []  # per level, where its last label ends
    levels = [0] * len(extents_s)
    for i in order:
        left, right = extents_s[i]
        free = [k for k, end in enumerate(ends) if end <= left]
        if free:
            lvl = free[0]
        else:
            lvl = len(ends)
            ends.append(-math.inf)
        levels[i] = lvl
        ends[lvl] = right
    return levels


def label_extent(m: ShiftMark, run_s: float, axes_width_in: float) -> tuple[float, float, bool]:
    """Where shift ``m``'s label goes on the x axis, s: ``(left, right, to_the_left)``. A label starts at
    the shift's start; one that would run past the run's end ends there instead (``to_the_left``)."""
    start = max(shift_interval(m, run_s)[0], 0.0)
    width = label_width_s(shift_label(m), run_s, axes_width_in)
    if start + width > run_s and start - width >= 0.0:
        return start - width, start, True
    return start, start + width, False


def _shade_shifts(ax: plt.Axes, marks: Sequence[ShiftMark], run_s: float) -> None:
    """Shade each shift's span (start → finish, or → the run's end while in progress) in its target
    gear's colour, hatched grey when it did not succeed, with a line at its start."""
    for m in marks:
        start, end = shift_interval(m, run_s)
        ok = m.outcome == "Succeeded" or m.finished_s is None
        ax.axvspan(
            start,
            end,
            facecolor=gear_colour(m.to_gear) if ok else "grey",
            alpha=0.13 if ok else 0.2,
            hatch=None if ok else "//",
            linewidth=0,
            zorder=0,
        )
        ax.axvline(start, color="black", linestyle=ROLE_STYLE.get(m.role, "-"), linewidth=1.0, alpha=0.7)


def _shift_levels(marks: Sequence[ShiftMark], run_s: float, axes_width_in: float) -> list[int]:
    """:func:`stagger_levels` of the shifts' labels on axes ``axes_width_in`` inches wide."""
    return stagger_levels([label_extent(m, run_s, axes_width_in)[:2] for m in marks])


def _label_shifts(
    ax: plt.Axes,
    marks: Sequence[ShiftMark],
    run_s: float,
    levels: Sequence[int],
    y: float,
    axes_width_in: float,
) -> None:
    """Label every shift at its start: at ``y`` (axes fraction), raised by ``LABEL_STEP_PT`` per level."""
    for m, lvl in zip(marks, levels, strict=True):
        left = label_extent(m, run_s, axes_width_in)[2]
        ann = ax.annotate(
            shift_label(m),
            xy=(max(shift_interval(m, run_s)[0], 0.0), y),
            xycoords=("data", "axes fraction"),
            xytext=(-2 if left else 2, 2 + LABEL_STEP_PT * lvl),
            textcoords="offset points",
            va="bottom",
            ha="right" if left else "left",
            fontsize=LABEL_FONT_PT,
            color="black" if m.outcome in ("Succeeded", "", "InProgress") else "dimgrey",
            annotation_clip=False,
        )
        ann.set_in_layout(False)  # the margins are sized for the labels; keep the panels' width fixed


def _bands(ax: plt.Axes, spans: Sequence[GearSpan], roles: Sequence[str]) -> None:
    """Draw, above the data, one thin band per role coloured by the gear it ran."""
    for i, role in enumerate(roles):
        y0 = 1.01 + 0.05 * i
        for s in spans:
            if s.role != role:
                continue
            ax.axvspan(
                s.start_s,
                s.end_s,
                ymin=y0,
                ymax=y0 + 0.04,
                color=gear_colour(s.gear),
                clip_on=False,
            )
        ax.annotate(
            role,
            xy=(1.005, y0 + 0.005),
            xycoords="axes fraction",
            fontsize=7,
            va="bottom",
            annotation_clip=False,
        )


def _line(ax: plt.Axes, s: Series | None, label: str, **kw: object) -> None:
    if s is None or not s.t or not s.finite():
        return
    ax.plot(s.t, s.v, label=label, **kw)  # type: ignore[arg-type]


TRAFFIC_WIDTH_IN = 11.0
TRAFFIC_HEIGHT_IN = 8.5
#: Width of the traffic plot's panels, inches (the figure less its margins, for label widths).
TRAFFIC_AXES_IN = 9.6


@dataclass
class TrafficData:
    """What :func:`plot_traffic` draws; any series may be missing (None)."""

    run_s: float
    offered_qps: Series | None
    wire: Mapping[str, Series]
    """:func:`gearshift.dev.demo.series.bin_wire` output."""
    router: Mapping[str, Series]
    """:func:`gearshift.dev.demo.series.router_series` output."""
    spans: Sequence[GearSpan]
    marks: Sequence[ShiftMark]
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    title: str = ""


def plot_traffic(data: TrafficData, out: Path) -> Path:
    """Three stacked panels (QPS, P99 TTFT, P99 ITL) over the run; writes ``out`` (PNG) and returns it."""
    fig, axes = plt.subplots(3, 1, figsize=(TRAFFIC_WIDTH_IN, TRAFFIC_HEIGHT_IN), sharex=True)
    ax_q, ax_t, ax_i = axes
    _line(ax_q, data.offered_qps, "offered (trace)", color="lightgrey", linewidth=2.5)
    _line(ax_q, data.wire.get("sent_qps"), "sent (load generator)", color="tab:blue", linewidth=1)
    _line(ax_q, data.wire.get("done_qps"), "completed (load generator)", color="tab:green", linewidth=1.2)
    _line(ax_q, data.router.get("qps"), "OK answers (router /metrics)", color="tab:orange", linewidth=1.2)
    ax_q.set_ylabel("requests/s")
    _line(ax_t, data.wire.get("ttft_p99_ms"), "P99 TTFT (load generator)", color="tab:blue", marker=".")
    _line(ax_t, data.router.get("ttft_p99_ms"), "P99 upstream TTFT (router)", color="tab:orange")
    if data.slo_ttft_ms:
        ax_t.axhline(data.slo_ttft_ms, color="red", linewidth=0.8, label=f"SLO {data.slo_ttft_ms:g} ms")
    ax_t.set_ylabel("ms")
    _line(ax_i, data.wire.get("itl_p99_ms"), "P99 ITL (load generator)", color="tab:blue", marker=".")
    _line(ax_i, data.router.get("itl_p99_ms"), "P99 upstream ITL (router)", color="tab:orange")
    if data.slo_itl_ms:
        ax_i.axhline(data.slo_itl_ms, color="red", linewidth=0.8, label=f"SLO {data.slo_itl_ms:g} ms")
    ax_i.set_ylabel("ms")
    ax_i.set_xlabel("seconds since the replay started")
    for ax in axes:
        ax.set_xlim(0, max(data.run_s, 1.0))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
        _shade_shifts(ax, data.marks, data.run_s)
    for ax in (ax_t, ax_i):
        vals = [
            v for s in ax.get_lines() for v in s.get_ydata() if isinstance(v, float) and not math.isnan(v)
        ]
        if vals and max(vals) > 20 * (sorted(vals)[len(vals) // 2] or 1):
            ax.set_yscale("log")  # one slow burst must not flatten the rest
    roles = sorted({s.role for s in data.spans})
    _bands(ax_q, data.spans, roles)
    # Shift labels go above the role bands, at each shift's start, so they never cover the data.
    levels = _shift_levels(data.marks, data.run_s, TRAFFIC_AXES_IN)
    _label_shifts(ax_q, data.marks, data.run_s, levels, 1.01 + 0.05 * len(roles), TRAFFIC_AXES_IN)
    n_levels = max(levels, default=-1) + 1
    # Grow the figure by the label rows so the panels keep their height.
    extra_in = n_levels * LABEL_STEP_PT / 72.0
    fig.set_figheight(TRAFFIC_HEIGHT_IN + extra_in)
    gears = sorted({s.gear for s in data.spans} | {m.to_gear for m in data.marks})
    handles = [Patch(color=gear_colour(g), label=f"gear {g}") for g in gears]
    if data.marks:
        handles.append(
            Patch(facecolor="lightgrey", label="shift under way: warm-up → drain → switch (target's colour)")
        )
    if handles:
        # A line below the title (0.3 in down), so a wide legend never covers it.
        fig.legend(
            handles=handles,
            loc="upper right",
            bbox_to_anchor=(0.995, 1.0 - 0.3 / (TRAFFIC_HEIGHT_IN + extra_in)),
            fontsize=8,
            ncol=min(len(handles), 4),
        )
    fig.suptitle(data.title or "Trace replay: QPS and P99 latency, gear shifts marked", x=0.01, ha="left")
    top = 1.0 - (0.07 * TRAFFIC_HEIGHT_IN + extra_in) / (TRAFFIC_HEIGHT_IN + extra_in)
    fig.tight_layout(rect=(0, 0, 0.97, top))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_utilization(
    per_role: Mapping[str, Sequence[Series]],
    marks: Sequence[ShiftMark],
    run_s: float,
    out: Path,
    title: str = "",
    spans: Sequence[GearSpan] = (),
) -> Path:
    """One panel per role, one line per ``gear/stage`` series (0..1 busy fraction); gears that served
    traffic (``spans``) are drawn solid, the others (shadows, planned gears) faint. Writes ``out``."""
    roles = list(per_role) or ["(none)"]
    fig, axes = plt.subplots(len(roles), 1, figsize=(11, 3.2 * len(roles) + 0.6), sharex=True, squeeze=False)
    for ax, role in zip(axes[:, 0], roles, strict=True):
        series = per_role.get(role, [])
        served = {sp.gear for sp in spans if sp.role == role}
        for s in series:
            gear, _, stage = s.name.partition("/")
            styles = ["-", "--", "-.", ":"]
            ax.plot(
                s.t,
                s.v,
                label=f"{gear} s{stage}",
                color=gear_colour(gear),
                linestyle=styles[int(stage) % 4] if stage.isdigit() else "-",
                alpha=1.0 if gear in served or not served else 0.45,
                linewidth=1.2,
            )
        role_marks = [m for m in marks if m.role == role]
        _shade_shifts(ax, role_marks, run_s)
        # Labels sit in a strip above the busy-fraction range (0..1.05), one row per level.
        levels = _shift_levels(role_marks, run_s, TRAFFIC_AXES_IN)
        top = 1.05 + 0.12 * (max(levels, default=-1) + 1)
        ax.set_ylim(0, top)
        _label_shifts(ax, role_marks, run_s, levels, 1.0 / top, TRAFFIC_AXES_IN)
        ax.set_xlim(0, max(run_s, 1.0))
        ax.set_ylabel(f"{role}\nbusy fraction")
        ax.grid(alpha=0.3)
        if series:
            ax.legend(loc="best", fontsize=7, ncol=4)
        else:
            ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center")
    axes[-1, 0].set_xlabel("seconds since the replay started")
    fig.suptitle(
        title or "Per-stage utilisation (gearshift:stage_utilization, Prometheus)", x=0.01, ha="left"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


@dataclass(frozen=True)
class NodeRow:
    """One GPU node of the fleet as its GPUProfile describes it."""

    name: str
    gpu_model: str
    gpus: int
    memory_gib: float | None
    score: float | None


@dataclass(frozen=True)
class StageCell:
    """A stage of a gear placed on a node: ``role``/``gear``, stage index and layer range [a, b)."""

    role: str
    gear: str
    stage: int
    layers: tuple[int, int]
    node: str
    ran: bool
    """Whether this gear served traffic during the run (drawn solid; planned-only gears are hatched)."""


def plot_placement(nodes: Sequence[NodeRow], cells: Sequence[StageCell], out: Path, title: str = "") -> Path:
    """A grid: rows are GPU nodes (labelled with model, memory, score), columns are ``role/gear``; a cell
    holds ``s<k> L<a>–<b>`` where that gear puts stage k on that node. Writes ``out``."""
    order = list(GEAR_COLOURS)  # latency, balanced, throughput: shallow to deep
    cols = sorted(
        {(c.role, c.gear) for c in cells},
        key=lambda rg: (rg[0] != "prefill", order.index(rg[1]) if rg[1] in order else len(order), rg[1]),
    )
    rows = list(nodes)
    fig_h = 1.2 + 0.42 * max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * max(len(cols), 1) + 2.6, fig_h))
    index = {n.name: i for i, n in enumerate(rows)}
    for j, (role, gear) in enumerate(cols):
        for c in cells:
            if (c.role, c.gear) != (role, gear) or c.node not in index:
                continue
            i = index[c.node]
            ax.add_patch(
                plt.Rectangle(
                    (j + 0.04, i + 0.08),
                    0.92,
                    0.84,
                    facecolor=gear_colour(gear),
                    alpha=0.85 if c.ran else 0.25,
                    hatch=None if c.ran else "//",
                    edgecolor="black" if c.ran else gear_colour(gear),
                )
            )
            a, b = c.layers
            ax.text(j + 0.5, i + 0.5, f"s{c.stage} L{a}–{b}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, max(len(cols), 1))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([j + 0.5 for j in range(len(cols))])
    ax.set_xticklabels([f"{r}\n{g}" for r, g in cols], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(len(rows))])

    def label(n: NodeRow) -> str:
        mem = f"{n.memory_gib:.0f} GiB" if n.memory_gib else "? GiB"
        score = f"score {n.score:.3g}" if n.score is not None else "score ?"
        return f"{n.name}  {n.gpus}× {n.gpu_model}, {mem}, {score}"

    ax.set_yticklabels([label(n) for n in rows], fontsize=8)
    for j in range(len(cols) + 1):
        ax.axvline(j, color="lightgrey", linewidth=0.6)
    ax.tick_params(length=0)
    legend = [
        Patch(facecolor="grey", alpha=0.85, edgecolor="black", label="served traffic in the run"),
        Patch(facecolor="grey", alpha=0.25, hatch="//", label="planned, not run"),
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.01), ncol=2, fontsize=8)
    ax.set_title(
        title or "Fleet and placement: which node hosts which stage of which gear", fontsize=10, pad=30
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
