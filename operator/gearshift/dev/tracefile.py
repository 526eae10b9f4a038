"""Trace files: the CSV the load generator replays and the twin reads (pure but for reading the file).

Columns ``TIMESTAMP,ContextTokens,GeneratedTokens`` (the Azure LLM inference trace 2023 format). Rows are
sorted by timestamp (a stable sort), offsets taken from the earliest; every row needs a finite timestamp
and at least 1 context and 1 generated token (vLLM refuses ``max_tokens`` 0), else the trace is refused
naming its line. One reader for both the wire replay (:mod:`gearshift.dev.loadgen`) and the twin
(:mod:`gearshift.dev.twin`), so both see the same requests at the same offsets.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


class TraceError(ValueError):
    """An unusable trace file; names the file, the line and the fix."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival offset from the first request (s, before scaling) and sizes."""

    offset_s: float
    prompt_tokens: int
    output_tokens: int


def _parse_ts(value: str, line: int) -> datetime:
    # The Azure trace has 7 fractional digits; datetime takes at most 6.
    head, dot, frac = value.strip().partition(".")
    text = f"{head}.{frac[:6]}" if dot else head
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(f"trace line {line}: TIMESTAMP {value!r} is not an ISO date-time") from None


TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _trace_text(path: Path) -> str:
    """The trace file's text (UTF-8, a byte-order mark allowed).

    Raises:
        TraceError: not UTF-8, naming the line of the first bad byte.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TraceError(
            f"{path} line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); the trace must be a "
            "UTF-8 CSV"
        ) from None


def _row_timestamp(raw: str, where: str) -> float:
    """A ``TIMESTAMP`` cell as seconds: a finite number, or an ISO date-time.

    Raises:
        TraceError: NaN, infinity or neither form, naming ``where``.
    """
    try:
        ts = float(raw)
    except ValueError:
        try:
            return _parse_ts(raw, 0).timestamp()
        except TraceError:
            raise TraceError(
                f"{where}: TIMESTAMP {raw!r} is neither an ISO date-time nor a number of seconds"
            ) from None
    if not math.isfinite(ts):
        raise TraceError(f"{where}: TIMESTAMP {raw!r} is not a finite number of seconds")
    return ts


def _row_tokens(raw: str, column: str, where: str) -> int:
    """A token-count cell: a whole number ≥ 1.

    Raises:
        TraceError: not a whole number, or below 1 (vLLM refuses an empty prompt and ``max_tokens`` 0:
        "max_tokens must be at least 1", vllm/sampling_params.py), naming ``where`` and ``column``.
    """
    try:
        value = int(raw)
    except ValueError:
        raise TraceError(f"{where}: {column} {raw!r} is not a whole number of tokens") from None
    if value < 1:
        what = "an empty prompt" if column == "ContextTokens" else "max_tokens 0"
        raise TraceError(
            f"{where}: {column} is {value}; each request needs at least 1 token (vLLM refuses {what}): "
            "fix or drop the row"
        )
    return value


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace CSV with columns ``TIMESTAMP`` (ISO date-time, or seconds as a finite number),
    ``ContextTokens`` and ``GeneratedTokens`` (whole numbers ≥ 1); rows sorted by time (a stable sort:
    rows of one instant keep the file's order), offsets in s from the earliest row, then the first
    ``limit`` rows of that order (the earliest ``limit`` requests, wherever they stand in the file).

    Raises:
        TraceError: a missing column, a non-UTF-8 file, or a bad row (too few cells, an unparsable,
            NaN or infinite timestamp, a token count that is not a whole number ≥ 1), naming the file
            and the line.
        OSError: the file cannot be read.
    """
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    reader = csv.DictReader(io.StringIO(_trace_text(path), newline=""))
    if not reader.fieldnames or not set(TRACE_COLUMNS) <= set(reader.fieldnames):
        raise TraceError(f"{path}: the trace needs columns {sorted(TRACE_COLUMNS)}, got {reader.fieldnames}")
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise TraceError(f"{path} line {reader.line_num}: not a CSV row ({exc})") from None
        where = f"{path} line {reader.line_num}"
        # DictReader fills the cells a short row lacks with None.
        missing = [c for c in TRACE_COLUMNS if row.get(c) is None]
        if missing:
            cells = sum(v is not None for k, v in row.items() if k is not None)
            raise TraceError(
                f"{where}: the row has {cells} of the header's {len(reader.fieldnames)} cells, no "
                f"{', '.join(missing)}"
            )
        ts = _row_timestamp(row["TIMESTAMP"], where)
        ctx = _row_tokens(row["ContextTokens"], "ContextTokens", where)
        gen = _row_tokens(row["GeneratedTokens"], "GeneratedTokens", where)
        rows.append((ts, ctx, gen))
    rows.sort(key=lambda r: r[0])
    if limit is not None:
        rows = rows[: max(0, limit)]
    t0 = rows[0][0] if rows else 0.0
    return [TraceRequest(ts - t0, ctx, gen) for ts, ctx, gen in rows]
