"""The process's event-loop lag, measured by a periodic timer and exported by every pod it serves
(:class:`~gearshift.sim.metrics.LoopLagCollector`): a simulator too busy to keep time says so."""

from __future__ import annotations

import asyncio
import contextlib
import time

from gearshift.sim.metrics import LoopLagCollector


class LoopLagMonitor:
    """Measures the process's event-loop lag with a periodic timer (one per process)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.last = 0.0
        self.worst = 0.0
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self.collector = LoopLagCollector(lambda: (self.last, self.worst))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.last = max(0.0, time.monotonic() - t0 - self.interval_s)
            self.worst = max(self.worst, self.last)
            if len(self.samples) < 100_000:
                self.samples.append(self.last)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
