"""The pod runner's log lines (stdout, one line each, with a UTC timestamp) and the timestamps it writes
into pod statuses."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_now() -> str:
    """Now as the API server writes times: ``2006-01-02T15:04:05Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def log(msg: str) -> None:
    """One line of the runner's log: the time, then ``msg``."""
    print(f"{utc_now()} {msg}", flush=True)
