"""A stand-in for kopf's ``DaemonStopped`` flag, for tests that drive a kopf daemon function directly."""

from __future__ import annotations


class OneTurn:
    """Lets a daemon's loop run one turn, then reads as stopped; ``wait`` returns at once."""

    def __init__(self) -> None:
        self.checks = 0

    def __bool__(self) -> bool:
        self.checks += 1
        return self.checks > 1

    async def wait(self, seconds: float) -> None:
        pass
