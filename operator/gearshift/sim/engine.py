"""The simulated engine: continuous batching over a paged KV-cache pool, timed by :mod:`perfmodel`.

The scheduler follows vLLM V1's (vllm/v1/core/sched/scheduler.py) in outline:

  - every step has a token budget (``max_batched_tokens``) and a sequence cap (``max_batch``, vLLM's
    ``--max-num-seqs``); running sequences go first (one token each when decoding, a chunk when still
    prefilling: chunked prefill), then waiting ones are admitted first-come first-served;
  - the KV cache is a pool of fixed blocks of ``block_size`` tokens; a sequence holds
    ``ceil(cached tokens / block_size)`` blocks. A waiting request whose blocks are not free waits
    (and blocks the queue behind it, as FCFS does). A running sequence that needs a new block when none
    is free preempts the newest running sequence (recompute style: its blocks are freed and it goes back
    to the front of the queue to prefill prompt + generated tokens again);
  - PD roles (docs/ARCHITECTURE.md): a ``prefill`` engine stops a request after its first token; a
    request carrying ``do_remote_prefill`` skips prefill compute and first waits for its KV to arrive
    (``prompt tokens × KV bytes per token`` over the KV link), then decodes.

Time: one timer per step, not per token. A step's duration comes from :meth:`PerfModel.step`; all its
sequences advance at its end. When the step timer fires late (the simulator's own overhead) the next
step starts from the planned end, up to :data:`MAX_CATCH_UP_S`, so the modelled GPU throughput holds.

Virtual time (benchmarks, tests): :meth:`Engine.begin_step` and :meth:`Engine.end_step` are the two halves
of one step of :meth:`Engine.run` without the timer, so a discrete-event driver can run engines with a
virtual ``clock`` and no wall-clock sleeps (``bench/gears.py``); :meth:`Engine.next_transfer_at` says
when an idle engine has work again without a new request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gearshift.sim.metrics import UTILIZATION_WINDOW_S, EngineMetrics
from gearshift.sim.perfmodel import DEFAULT_LINK, Link, PerfModel, Work

#: Most lateness a step may make up by starting the next step at its planned time, s.
MAX_CATCH_UP_S = 0.02

ROLES = ("prefill", "decode", "both")


class EngineConfigError(ValueError):
    """An engine that cannot run (e.g. the weights leave no room for KV cache); names the fix."""


class RequestRejected(ValueError):
    """A request the engine can never serve; the server answers HTTP 400 with this message."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)
class SimRequest:
    """One request's state inside the engine."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    remote_kv_tokens: int = 0
    """Tokens of KV cache to pull from a prefill pod before decoding (0: prefill locally)."""
    prefill_only: bool = False
    """Stop after the first token (a prefill pod's half of a PD request)."""

    computed: int = 0
    """Tokens whose KV is cached."""
    prefill_target: int = 0
    """Tokens to have cached before the next token comes out (prompt, + generated after a preemption)."""
    generated: int = 0
    blocks: int = 0
    first_block: int = 0
    ready_at: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    pending: int = 0
    """Tokens produced and not yet taken by the HTTP handler."""
    _waiter: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        self._waiter = None

    async def token_batches(self) -> AsyncIterator[int]:
        """Yield the number of new tokens after each step that produced some, until the request ends."""
        while True:
            if self.pending:
                n, self.pending = self.pending, 0
                yield n
                continue
            if self.finished:
                return
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def wait_finished(self) -> None:
        """Return once the request has finished (any reason)."""
        while not self.finished:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self.pending = 0


@dataclass(frozen=True)
class PlannedStep:
    """One engine step chosen by :meth:`Engine.begin_step`: its batch and modelled timing, times in s."""

    batch: list[tuple[SimRequest, int]]
    start: float
    """When the step starts (the engine's clock)."""
    end: float
    """When it ends: ``start`` + the modelled period."""
    stage_busy_s: list[float]
    """Busy time of each stage within the step, s."""


class Engine:
    """One simulated vLLM engine (a head pod): scheduler, KV pool, step loop and metrics."""

    def __init__(
        self,
        model: PerfModel,
        *,
        role: str = "both",
        model_name: str = "model",
        max_model_len: int | None = None,
        kv_link: Link = DEFAULT_LINK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if role not in ROLES:
            raise EngineConfigError(f"role {role!r} must be one of {ROLES} (GEARSHIFT_ROLE)")
        self.model = model
        self.role = role
        self.clock = clock
        self.kv_link = kv_link
        self.block_size = model.params.block_size
        self.total_blocks = model.kv_capacity_blocks()
        if self.total_blocks < 1:
            tight = min(range(len(model.pipeline.stages)), key=model.stage_kv_tokens)
            st = model.pipeline.stages[tight]
            raise EngineConfigError(
                f"stage {tight} ({st.gpu} x{st.gpus}, layers {st.start}-{st.end}) has no memory left for "
                f"KV cache after {model.stage_weight_bytes(tight) / 2**30:.1f} GiB of weights: "
                "give it fewer layers or more cards"
            )
        capacity_tokens = self.total_blocks * self.block_size
        # As vLLM: the model's own limit unless one is given, and never more than the KV pool holds (vLLM
        # refuses to start then; the simulator serves the shorter limit so every pod still answers).
        limit = max_model_len or model.arch.max_position_embeddings or capacity_tokens
        self.max_model_len = min(limit, capacity_tokens)
        self.free_blocks = self.total_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.transferring: list[SimRequest] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._block_cursor = 0
        self._util: deque[tuple[float, float, list[float]]] = deque()
        self.steps = 0
        self.planned_s = 0.0
        self.lag_s = 0.0
        self.lag_max_s = 0.0
        self.metrics = EngineMetrics(self, model_name, max_model_len=self.max_model_len)

    # --- gauges (read by the metrics collector) --------------------------------------------------
    def num_running(self) -> int:
        return len(self.running) + len(self.transferring)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    def stage_utilization(self) -> list[float]:
        """Busy fraction of each stage over the last :data:`UTILIZATION_WINDOW_S` seconds."""
        now = self.clock()
        while self._util and self._util[0][1] < now - UTILIZATION_WINDOW_S:
            self._util.popleft()
        busy = [0.0] * len(self.model.pipeline.stages)
        lo = now - UTILIZATION_WINDOW_S
        for start, end, per_stage in self._util:
            # A step partly inside the window counts for the part inside.
            frac = 1.0 if start >= lo else (end - lo) / (end - start)
            for k, b in enumerate(per_stage):
                busy[k] += b * frac
        return [min(1.0, b / UTILIZATION_WINDOW_S) for b in busy]

    # --- requests --------------------------------------------------------------------------------
    def new_request(
        self, prompt_tokens: int, max_tokens: int, *, remote_kv_tokens: int = 0, prefill_only: bool = False
    ) -> SimRequest:
        """Validate and enqueue a request; returns its handle.

        Raises:
            RequestRejected: prompt + max_tokens over the model length the KV pool allows, or
                non-positive counts.
        """
        if prompt_tokens < 1:
            raise RequestRejected("the prompt must hold at least one token", "prompt")
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        if self.role == "prefill":
            prefill_only = True
        req = SimRequest(
            request_id=f"cmpl-{next(self._ids)}",
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrival=self.clock(),
            remote_kv_tokens=remote_kv_tokens,
            prefill_only=prefill_only,
            prefill_target=prompt_tokens,
        )
        self.waiting.append(req)
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client gone): free its blocks and finish it with reason ``abort``."""
        if req.finished:
            return
        for queue in (self.running, self.transferring):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort", self.clock())

    def _free(self, req: SimRequest) -> None:
        self.free_blocks += req.blocks
        req.blocks = 0

    def _grow(self, req: SimRequest, tokens: int) -> int:
        """Blocks ``req`` lacks to cache ``tokens`` tokens."""
        return max(0, math.ceil(tokens / self.block_size) - req.blocks)

    def _take(self, req: SimRequest, n: int) -> None:
        if req.blocks == 0:
            req.first_block = self._block_cursor
        self._block_cursor = (self._block_cursor + n) % self.total_blocks
        req.blocks += n
        self.free_blocks -= n

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.computed = 0
        victim.remote_kv_tokens = 0
        victim.prefill_target = victim.prompt_tokens + victim.generated
        victim.preemptions += 1
        self.metrics.preemptions.inc()
        self.waiting.appendleft(victim)

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        self._free(req)
        req.finish_reason = reason
        req.finished_at = now
        m = self.metrics
        m.success(reason)
        m.finished_tokens(req.prompt_tokens, req.generated)
        if reason != "abort":
            m.e2e.observe(now - req.arrival)
            if req.generated > 1 and req.first_token_at is not None:
                m.tpot.observe((now - req.first_token_at) / (req.generated - 1))
        req._wake()

    # --- scheduling ------------------------------------------------------------------------------
    def schedule(self, now: float) -> list[tuple[SimRequest, int]]:
        """Pick this step's work: ``(request, tokens to compute)`` pairs. Allocates KV blocks,
        preempting the newest running sequences when the pool runs dry."""
        pipe = self.model.pipeline
        budget = pipe.max_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        if self.transferring:
            still = []
            for r in self.transferring:
                if r.ready_at <= now:
                    self.running.append(r)
                else:
                    still.append(r)
            self.transferring = still
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = 1 if r.computed >= r.prefill_target else min(r.prefill_target - r.computed, budget)
            need = self._grow(r, r.computed + n)
            while need > self.free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
            if r not in self.running:
                break  # r preempted itself: everything after it went too
            self._take(r, need)
            batch.append((r, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and self.num_running() < pipe.max_batch:
            r = self.waiting[0]
            if r.remote_kv_tokens:
                need = self._grow(r, r.remote_kv_tokens + 1)
                if need > self.free_blocks:
                    break
                self.waiting.popleft()
                self._take(r, need)
                r.computed = r.prefill_target = r.remote_kv_tokens
                r.ready_at = now + self.model.kv_transfer_s(r.remote_kv_tokens, self.kv_link)
                self.transferring.append(r)
                continue
            n = min(r.prefill_target - r.computed, budget)
            need = self._grow(r, r.computed + n)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self._take(r, need)
            self.running.append(r)
            batch.append((r, n))
            budget -= n
        return batch

    def complete(self, batch: list[tuple[SimRequest, int]], now: float) -> None:
        """Apply a finished step: advance caches, emit tokens, finish requests, observe metrics."""
        m = self.metrics
        prompt = gen = 0
        for r, n in batch:
            if r.finished:
                continue  # aborted mid-step
            if r.computed < r.prefill_target:
                prompt += n
            else:
                gen += n
            r.computed += n
            if r.computed < r.prefill_target:
                continue  # a prefill chunk that did not finish the prompt
            r.generated += 1
            r.pending += 1
            if r.first_token_at is None:
                r.first_token_at = now
                m.ttft.observe(now - r.arrival)
            elif r.last_token_at is not None:
                m.itl.observe(now - r.last_token_at)
            r.last_token_at = now
            r.prefill_target = r.computed  # from here on each step computes one token
            if r.generated >= r.max_tokens or r.prefill_only:
                self.running.remove(r)
                self._finish(r, "length", now)
            else:
                r._wake()
        if prompt:
            m.prompt_tokens.inc(prompt)
        if gen:
            m.generation_tokens.inc(gen)

    # --- the step loop ---------------------------------------------------------------------------
    def next_transfer_at(self) -> float | None:
        """When the earliest pending KV transfer lands (s, the engine's clock), or ``None``."""
        return min((r.ready_at for r in self.transferring), default=None)

    _next_transfer = next_transfer_at

    def begin_step(self, start: float, *, schedule_at: float | None = None) -> PlannedStep | None:
        """Schedule the step that starts at ``start`` (s) and model its duration; ``None`` when nothing is
        schedulable now (idle, a KV transfer pending, or blocks short). Call :meth:`end_step` at its end.

        ``schedule_at`` (default ``start``): the time the scheduler sees (KV transfers landed by then);
        :meth:`run` passes the wall clock while ``start`` catches up on a late timer."""
        batch = self.schedule(start if schedule_at is None else schedule_at)
        if not batch:
            return None
        timing = self.model.step(Work(n, r.computed) for r, n in batch)
        return PlannedStep(batch, start, start + timing.period_s, timing.stage_busy_s)

    def end_step(self, step: PlannedStep, at: float | None = None) -> None:
        """Apply a step begun by :meth:`begin_step`: count it, record stage utilisation over
        ``[start, end]``, and emit its tokens at ``at`` (s; default the planned end, as in virtual time).
        ``at`` later than the planned end is counted as timer lag."""
        actual = step.end if at is None else at
        lag = max(0.0, actual - step.end)
        self.steps += 1
        self.planned_s += step.end - step.start
        self.lag_s += lag
        self.lag_max_s = max(self.lag_max_s, lag)
        self.metrics.step_lag.observe(lag)
        self._util.append((step.start, step.end, step.stage_busy_s))
        self.complete(step.batch, actual)

    async def run(self) -> None:
        """Run steps forever (cancel the task to stop): one timer per step."""
        start = self.clock()
        while True:
            now = self.clock()
            planned = self.begin_step(start, schedule_at=max(start, now))
            if planned is None:
                self._wake.clear()
                nxt = self._next_transfer()
                if nxt is None and not self.waiting:
                    await self._wake.wait()
                else:
                    # Waiting on a KV transfer or on blocks: sleep until the transfer lands (or new work).
                    delay = max(0.0, (nxt - now) if nxt is not None else 0.005)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), delay)
                start = self.clock()
                continue
            end = planned.end
            await asyncio.sleep(end - self.clock())
            actual = self.clock()
            self.end_step(planned, actual)
            start = end if actual - end < MAX_CATCH_UP_S else actual

    def stats(self) -> dict[str, float | int]:
        """Counters of the simulator's own accuracy: steps, modelled step seconds, total/max lag (s)."""
        return {
            "steps": self.steps,
            "planned_step_s": self.planned_s,
            "lag_s": self.lag_s,
            "lag_max_s": self.lag_max_s,
            "total_blocks": self.total_blocks,
            "free_blocks": self.free_blocks,
            "running": self.num_running(),
            "waiting": self.num_waiting(),
        }
