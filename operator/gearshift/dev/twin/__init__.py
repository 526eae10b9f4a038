"""The twin: the operator's gears and control loop on simulated engines, in virtual time.

``bench/gears.py`` runs it over whole trace hours; ``gearshift demo`` replays the window it served with the
shifting loop, on each of the service's gears and on each layout a peer system would deploy
(:mod:`~gearshift.dev.twin.compare`, :func:`~gearshift.dev.twin.gears.peer_gears`), so its report puts
the live run beside them on the same requests.

What is real and what is modelled:

- **Real code**: the planner (:func:`gearshift.planner.plan` on the fleet's resource profile, as the
  operator's reconciler calls it, ``sim_requests=500`` as its ``Settings``), the API gears
  (:func:`gearshift.planner.inputs.api_gear`), the simulated engine's pipeline document
  (:func:`gearshift.k8s.engine.sim_pipeline` with :func:`gearshift.planner.inputs.gear_links`), the simulated
  engine itself (:class:`gearshift.sim.engine.Engine`: its scheduler, paged KV pool, preemption and
  :class:`~gearshift.sim.perfmodel.PerfModel` roofline timing, driven by its ``begin_step``/``end_step``
  hook), and the operator's pure control code: :func:`gearshift.control.shifting.decide.decide`,
  :func:`gearshift.control.shifting.executor.step`, :func:`gearshift.control.shifting.adapt.policy_from_api`
  with the GearSet API's default :class:`~gearshift.api.shift_policy.ShiftPolicy`.
- **Simulated here**: time (virtual: one trace hour = 3600 virtual seconds, no wall-clock sleeps); the
  router (shortest queue, ``running + waiting``, over the selected gear's head pods, each queue divided by
  the head's GPU prior -- the PD router's seed-000 prior, :func:`gearshift.facts.gpus.pd_gpu_prior`, of its
  slowest card -- so that a whole-model replica on an A100 beside the H100s takes a smaller share, as the
  real router's GPU term does; identical heads reduce to plain shortest queue); Prometheus (the same numbers
  its queries would give: stage utilisation from the engines' gauge, summed queue/running, completions over
  the last minute, P50/P99 by ``histogram_quantile`` interpolation over the engines' own histogram buckets
  of the last minute); the Kubernetes side of the executor's actions (``EnsureGear`` creates the gear's
  engines, Ready after its weights load at the policy's ``transferGbps``; ``SelectGear`` moves new requests;
  the old gear keeps and finishes its in-flight requests; ``DeleteGear`` removes it, failing whatever it
  still holds).
- **Modelled since shifting had to pay for itself** (see :class:`~gearshift.dev.twin.engines.Sim`): engines
  sharing a card split its time (a warming shadow gets at most ``warmupShare``), warm-up traffic mirrored to a
  Ready shadow as the router does, the cards every live gear holds over time, and the signal window the
  operator uses after a switch (:func:`gearshift.control.signals.sample_window_s`).
- **Not modelled**: prefill/decode disaggregation (the engines run the combined ``both`` role on the
  whole fleet), weight loading contending with serving, network between client and router.

A request the engine refuses at admission (longer than its KV pool can ever hold: vLLM answers 400, on
every gear alike) is counted as ``rejected_too_long``, not as failed. A request *fails* when its first
token comes more than :data:`CLIENT_TIMEOUT_S` (60 s) after arrival (the client gave up; the engine is not
told), when it is still unfinished at the end of the run, or when its gear is deleted under it. It meets
the SLO when its TTFT and its mean inter-token latency (TPOT, ``(last − first token) / (tokens − 1)``)
are within the SLO (DESIGN.md's 200 ms and 50 ms by default; TPOT as DistServe's goodput, Zhong et al.
OSDI 2024). Goodput = requests meeting the SLO / trace duration (requests/s).

Modules: :mod:`~gearshift.dev.twin.trace` (arrivals), :mod:`~gearshift.dev.twin.gears` (the planner's
gears, a GearSet's planned gears and the peers' uniform layouts as the twin runs them),
:mod:`~gearshift.dev.twin.compare` (one window replayed dynamic, per gear and per peer layout),
:mod:`~gearshift.dev.twin.engines` (the simulated world),
:mod:`~gearshift.dev.twin.variant` (one replay and its figures). No Kubernetes, HTTP or wall-clock
sleeps: a replay is CPU only.
"""

from __future__ import annotations

from gearshift.dev.twin.constants import CLIENT_TIMEOUT_S, SLO_ITL_S, SLO_TTFT_S, WINDOW_S, Slo
from gearshift.dev.twin.engines import Head, LiveGear, Sim
from gearshift.dev.twin.gears import (
    FLEET,
    MODEL,
    GearSpec,
    is_upshift,
    plan_gears,
    shift_lead_s,
    with_max_batch,
)
from gearshift.dev.twin.trace import Trace, load_trace, trace_from_requests
from gearshift.dev.twin.variant import run_variant

__all__ = [
    "CLIENT_TIMEOUT_S",
    "FLEET",
    "MODEL",
    "SLO_ITL_S",
    "SLO_TTFT_S",
    "WINDOW_S",
    "GearSpec",
    "Head",
    "LiveGear",
    "Sim",
    "Slo",
    "Trace",
    "is_upshift",
    "load_trace",
    "plan_gears",
    "run_variant",
    "shift_lead_s",
    "trace_from_requests",
    "with_max_batch",
]
