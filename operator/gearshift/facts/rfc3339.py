"""RFC 3339 date-times as the API server and the probe write them (``2025-01-31T18:00:00Z``), and the
codec of the times the operator stores in status (epoch seconds in memory, RFC 3339 UTC strings in status)."""

from __future__ import annotations

from datetime import UTC, datetime


def from_rfc3339(text: str) -> datetime:
    """``text`` as a datetime, a ``Z`` read as ``+00:00`` (UTC).

    Aware when ``text`` states an offset, naive when it states none: callers that need an offset check
    ``tzinfo`` (:func:`gearshift.profiling.lifecycle.parse_rfc3339` does).

    Raises:
        ValueError: ``text`` is not an ISO 8601 date-time.
    """
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def to_time(ts: float | None) -> str | None:
    """Epoch seconds → RFC 3339 UTC with microseconds (as status stores times), ``None`` passes."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def from_time(dt: datetime | str | None) -> float | None:
    """RFC 3339 time (or an aware datetime) → epoch seconds; ``None`` passes.

    Raises:
        ValueError: a string that is not an ISO 8601 date-time.
    """
    if dt is None:
        return None
    if isinstance(dt, str):
        dt = from_rfc3339(dt)
    return dt.timestamp()
