"""RFC 3339 date-times as the API server and the probe write them (``2025-01-31T18:00:00Z``)."""

from __future__ import annotations

from datetime import datetime


def from_rfc3339(text: str) -> datetime:
    """``text`` as a datetime, a ``Z`` read as ``+00:00`` (UTC).

    Aware when ``text`` states an offset, naive when it states none: callers that need an offset check
    ``tzinfo`` (:func:`gearshift.profiling.lifecycle.parse_rfc3339` does).

    Raises:
        ValueError: ``text`` is not an ISO 8601 date-time.
    """
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
