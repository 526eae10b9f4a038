"""The demo report's PNG plots, drawn with matplotlib's Agg backend from plain data (no cluster access).

- :func:`plot_traffic`: QPS, P99 TTFT and P99 ITL over the run, wire and router measurements side by
  side, SLO lines, which gear each role ran (bands) and every gear shift (vertical lines);
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

from gearshift.demo.series import GearSpan, Series, ShiftMark

#: One colour per gear intent, used for bands, placement cells and legends alike.
GEAR_COLOURS = {"latency": "#4C72B0", "balanced": "#55A868", "throughput": "#C44E52"}
_EXTRA = ["#8172B2", "#CCB974", "#64B5CD", "#937860", "#DA8BC3"]
ROLE_STYLE = {"prefill": "--", "decode": ":"}


def gear_colour(gear: str) -> str:
    """A stable colour for a gear name (intent names get theirs; others a hashed one)."""
    return GEAR_COLOURS.get(gear) or _EXTRA[sum(map(ord, gear)) % len(_EXTRA)]


def _mark_shifts(ax: plt.Axes, marks: Sequence[ShiftMark], label: bool) -> None:
    for m in marks:
        at = m.finished_s if m.finished_s is not None else m.started_s
        style = ROLE_STYLE.get(m.role, "-")
        colour = "black" if m.outcome == "Succeeded" else "grey"
        ax.axvline(at, color=colour, linestyle=style, linewidth=1.2, alpha=0.8)
        if label:
            txt = f"{m.role}: {m.from_gear or '?'}→{m.to_gear}"
            if m.outcome != "Succeeded":
                txt += f" ({m.outcome})"
            ax.annotate(
                txt,
                xy=(at, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                rotation=90,
                va="top",
                fontsize=7,
            )


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


@dataclass
class TrafficData:
    """What :func:`plot_traffic` draws; any series may be missing (None)."""

    run_s: float
    offered_qps: Series | None
    wire: Mapping[str, Series]
    """:func:`gearshift.demo.series.bin_wire` output."""
    router: Mapping[str, Series]
    """:func:`gearshift.demo.series.router_series` output."""
    spans: Sequence[GearSpan]
    marks: Sequence[ShiftMark]
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    title: str = ""


def plot_traffic(data: TrafficData, out: Path) -> Path:
    """Three stacked panels (QPS, P99 TTFT, P99 ITL) over the run; writes ``out`` (PNG) and returns it."""
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
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
        _mark_shifts(ax, data.marks, label=ax is ax_q)
    for ax in (ax_t, ax_i):
        vals = [
            v for s in ax.get_lines() for v in s.get_ydata() if isinstance(v, float) and not math.isnan(v)
        ]
        if vals and max(vals) > 20 * (sorted(vals)[len(vals) // 2] or 1):
            ax.set_yscale("log")  # one slow burst must not flatten the rest
    roles = sorted({s.role for s in data.spans})
    _bands(ax_q, data.spans, roles)
    gears = sorted({s.gear for s in data.spans})
    handles = [Patch(color=gear_colour(g), label=f"gear {g}") for g in gears]
    if handles:
        fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
    fig.suptitle(data.title or "Trace replay: QPS and P99 latency, gear shifts marked", x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 0.97, 0.93))
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
        ax.set_ylim(0, 1.05)
        ax.set_xlim(0, max(run_s, 1.0))
        ax.set_ylabel(f"{role}\nbusy fraction")
        ax.grid(alpha=0.3)
        if series:
            ax.legend(loc="best", fontsize=7, ncol=4)
        else:
            ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center")
        _mark_shifts(ax, [m for m in marks if m.role == role], label=True)
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
