"""The twin's constants: SLOs, timeouts and windows (one place; bench/gears.py and the demo read them)."""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.control.reconcile.settings import SIM_REQUESTS

#: SLOs (DESIGN.md: target TTFT 200 ms, target ITL 50 ms), s.
SLO_TTFT_S = 0.200
SLO_ITL_S = 0.050
#: A client gives up when the first token is later than this, s (the brief's "timeouts > 60 s").
CLIENT_TIMEOUT_S = 60.0
#: vLLM's ``--gpu-memory-utilization`` default; the reconciler's resource profile scales memory by it
#: (:func:`gearshift.planner.inputs.resource_profile`).
MEMORY_UTILIZATION = 0.9
#: The reconciler's planner setting (its default ``Settings.sim_requests``).
PLAN_SIM_REQUESTS = SIM_REQUESTS
#: How long an engine that has waiting requests but could schedule nothing retries (Engine.run's poll), s.
RETRY_S = 0.005
#: Most virtual seconds simulated after the last arrival, to let in-flight requests finish.
TAIL_S = 300.0
#: Failure reason of a request the engine refuses at admission (longer than its KV pool can ever hold).
REJECTED = "rejected by the engine"
#: Goodput windows ("goodput per 60 s window"), s.
WINDOW_S = 60.0


@dataclass(frozen=True)
class Slo:
    """What a request must meet to count: TTFT and TPOT (mean inter-token latency) bounds, s."""

    ttft_s: float = SLO_TTFT_S
    itl_s: float = SLO_ITL_S


#: DESIGN.md's targets: TTFT 200 ms, TPOT 50 ms.
DEFAULT_SLO = Slo()
