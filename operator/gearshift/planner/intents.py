"""The gears' intents and the utilisation at which a gear is said to suit a load: the vocabulary the gear
planner (:mod:`gearshift.planner.gears`) and the fleet-scale planner (:mod:`gearshift.planner.fleetplan`)
share.

``INTENTS`` maps each intent to the micro-batch sizes its gears try (latency 1-4, balanced 4-8, throughput
8-16; DESIGN.md).
"""

from __future__ import annotations

#: Micro-batch sizes each intent's gears try.
INTENTS: dict[str, tuple[int, ...]] = {"latency": (1, 2, 4), "balanced": (4, 8), "throughput": (8, 16)}
#: Utilisation up to which a gear is said to suit a load.
TARGET_UTILISATION = 0.8
