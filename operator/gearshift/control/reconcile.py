"""The PDService reconciler's decisions, without I/O: :mod:`gearshift.handlers.reconcile` reads and writes."""

from __future__ import annotations

#: Executor steps during which the executor, not the reconciler, owns the role's gears and selector
#: (Degraded is the executor's weights-first warming).
SHIFT_STEPS = ("Warming", "Draining", "Switching", "RollingBack", "Degraded")
