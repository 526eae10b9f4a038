"""``gearshift loadgen``: replay an LLM request trace against OpenAI-compatible URLs and measure on the wire.

The trace is a CSV with a timestamp, the context (prompt) tokens and the generated tokens of every request
(Azure LLM inference trace 2023 format: ``TIMESTAMP,ContextTokens,GeneratedTokens``). Requests keep their
relative arrival times divided by ``time_scale`` (10 → ten times faster). Each request asks for exactly
its generated tokens: ``max_tokens`` = generated, ``ignore_eos: true`` (vLLM's extension).

Prompts: on ``/v1/completions`` (the default) the prompt is a list of token ids of the trace's length, so
vLLM and the simulator both count it exactly; on ``/v1/chat/completions`` it is that many words, which
the simulator counts one token per word (a real tokenizer counts differently, plus its chat template).

Measurements come from the client side only: TTFT = first content chunk - send time; ITL = gaps between
content chunks; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = last byte - send time. Output tokens
come from the final ``usage`` chunk when the server sends one, else from the number of content chunks.
A request meets the SLO when TTFT ≤ ``slo_ttft_ms`` and TPOT ≤ ``slo_itl_ms`` (DistServe's goodput, Zhong
et al. OSDI 2024); goodput = such requests per second of the run. With only one of the two bounds given,
goodput checks that one. Without streaming only E2E is measured (and no goodput).

Trace rows (:mod:`gearshift.dev.tracefile`): sorted by timestamp, offsets from the earliest; every row
needs a finite timestamp and at least 1 context and 1 generated token (vLLM refuses ``max_tokens`` 0),
else the trace is refused naming its line.

Context limit: a row whose context plus generated tokens exceed the ``max_model_len`` the servers give in
``/v1/models`` (vLLM's field; the smallest over the URLs, as any row may go to any of them) is clipped to
fit, its prompt shortened first, and counted as ``clipped``: a replay keeps every arrival, and vLLM refuses
such a request with a 400 (the trace's longest conversation row, 14,050 tokens, does not fit Llama-3-8B's
8,192). ``clip=False`` sends the rows as they are.

Bounds: at most ``max_requests`` requests, issued during at most ``max_duration_s`` seconds; requests
still running ``max_duration_s + drain_s`` seconds after the start (``drain_s`` after the issuing window,
even when the trace ran out sooner) are cancelled and counted as ``incomplete``.
By default only loopback URLs are accepted (the sandbox's network rule); ``allow_remote`` lifts that.

Exit status of the command: 0 when every issued request completed, 1 when any failed or was incomplete
(``--exit-zero``: 0 all the same), 2 on bad input (a flag, the trace, a URL).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from gearshift.dev.tracefile import TRACE_COLUMNS as TRACE_COLUMNS
from gearshift.dev.tracefile import TraceError as TraceError
from gearshift.dev.tracefile import TraceRequest as TraceRequest
from gearshift.dev.tracefile import load_trace as load_trace

#: The trace that ships with gearshift (Azure LLM inference trace 2023, conversation service; source,
#: licence and columns in ``gearshift/data/README.md``). Package data, resolved from this module's file and
#: not from the current directory, so it is found after ``pip install -e .`` and a plain ``pip install .``
#: alike. Every default trace path (the demo, the benchmarks, the tests) is this one.
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "azure_llm_2023_conv.csv"


class LoadgenError(ValueError):
    """Unusable load-generator input (URL, bounds); names the field and the fix. A bad trace file raises
    :class:`~gearshift.dev.tracefile.TraceError`."""


@dataclass
class RequestRecord:
    """What one request measured on the wire (times in s; None when not measured)."""

    url: str
    prompt_tokens: int
    max_tokens: int
    sent_at: float
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itls_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _pcts(values: Sequence[float], scale: float = 1000.0) -> dict[str, float] | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=float) * scale
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class LoadResult:
    """Summary of a run; latencies in ms, rates per second of the run's wall time."""

    urls: list[str]
    stream: bool
    time_scale: float
    duration_s: float
    issue_s: float
    """Seconds over which requests were issued (the offered rate's denominator)."""
    issued: int
    completed: int
    failed: int
    incomplete: int
    request_rate: float
    throughput_rps: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    tpot_ms: dict[str, float] | None
    e2e_ms: dict[str, float] | None
    slo_ttft_ms: float | None
    slo_itl_ms: float | None
    slo_met: int | None
    goodput_rps: float | None
    errors: dict[str, int]
    clipped: int = 0
    """Requests shortened to the server's ``max_model_len`` (see the module docstring)."""
    max_model_len: int | None = None
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def to_dict(self, with_records: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_records:
            d.pop("records")
        return d


def summarize(
    records: Sequence[RequestRecord],
    *,
    urls: Sequence[str],
    stream: bool,
    time_scale: float,
    duration_s: float,
    issued: int,
    slo_ttft_ms: float | None,
    slo_itl_ms: float | None,
    issue_s: float | None = None,
    clipped: int = 0,
    max_model_len: int | None = None,
) -> LoadResult:
    """Percentiles, throughput and SLO goodput of finished ``records`` over a run of ``duration_s`` s.

    Goodput needs streaming and at least one bound: a request meets the SLO when its TTFT ≤
    ``slo_ttft_ms`` and its TPOT ≤ ``slo_itl_ms`` (ms); a bound left None is not checked (a request of one
    output token has no TPOT and meets any TPOT bound)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and r.error != "incomplete"]
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error or f"HTTP {r.status}"
        errors[key] = errors.get(key, 0) + 1
    dur = max(duration_s, 1e-9)
    met: int | None = None
    if stream and (slo_ttft_ms is not None or slo_itl_ms is not None):
        # A bound not given holds for every request: with only one of the two, goodput counts the
        # requests that meet that one.
        met = 0
        for r in done:
            tpot = r.tpot_s
            ttft_ok = slo_ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1e3 <= slo_ttft_ms)
            tpot_ok = slo_itl_ms is None or tpot is None or tpot * 1e3 <= slo_itl_ms
            met += ttft_ok and tpot_ok
    return LoadResult(
        urls=list(urls),
        stream=stream,
        time_scale=time_scale,
        duration_s=duration_s,
        issue_s=duration_s if issue_s is None else issue_s,
        issued=issued,
        completed=len(done),
        failed=len(failed),
        incomplete=sum(1 for r in records if r.error == "incomplete"),
        request_rate=issued / max(duration_s if issue_s is None else issue_s, 1e-9),
        throughput_rps=len(done) / dur,
        output_tokens_per_s=sum(r.output_tokens for r in done) / dur,
        ttft_ms=_pcts([r.ttft_s for r in done if r.ttft_s is not None]),
        itl_ms=_pcts([g for r in done for g in r.itls_s]),
        tpot_ms=_pcts([t for r in done if (t := r.tpot_s) is not None]),
        e2e_ms=_pcts([r.e2e_s for r in done if r.e2e_s is not None]),
        slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=slo_itl_ms,
        slo_met=met,
        goodput_rps=None if met is None else met / dur,
        errors=errors,
        clipped=clipped,
        max_model_len=max_model_len,
        records=list(records),
    )


def _check_bounds(
    time_scale: float,
    max_requests: int,
    max_duration_s: float,
    drain_s: float,
    slo_ttft_ms: float | None,
    slo_itl_ms: float | None,
) -> None:
    """Refuse a bound of :func:`run_load` outside its range, naming the flag that sets it.

    Raises:
        LoadgenError: NaN, infinity, or a value out of range.
    """
    positive: dict[str, float | None] = {"--time-scale": time_scale, "--max-duration": max_duration_s}
    positive |= {"--slo-ttft-ms": slo_ttft_ms, "--slo-itl-ms": slo_itl_ms}
    for flag, value in positive.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise LoadgenError(f"{flag} must be a finite number above 0, got {value}")
    if not (math.isfinite(drain_s) and drain_s >= 0):
        raise LoadgenError(f"--drain must be a finite number of seconds, 0 or more, got {drain_s}")
    if max_requests < 1:
        raise LoadgenError(f"--max-requests must be at least 1, got {max_requests}")


def finite_number(minimum: float, inclusive: bool, unit: str) -> Any:
    """An argparse type: a finite float above ``minimum`` (or equal to it with ``inclusive``); the
    error names the range and ``unit``, and argparse puts the flag before it."""
    low = f"{minimum:g} or more" if inclusive else f"above {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number ({unit})") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number {low} ({unit})")
        return value

    return parse


def positive_int(text: str) -> int:
    """An argparse type for an integer >= 1 (argparse names the flag before the message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return value


def check_url(url: str, allow_remote: bool = False) -> str:
    """Normalise a base URL (``http://host:port``, with or without ``/v1``) and enforce loopback.

    Raises:
        LoadgenError: not http(s), or a non-loopback host without ``allow_remote``.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadgenError(f"--url {url!r} must look like http://127.0.0.1:8000")
    if not allow_remote:
        host = parts.hostname
        try:
            loop_ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loop_ok = host == "localhost"
        if not loop_ok:
            raise LoadgenError(
                f"--url {url!r} is not a loopback address; the sandbox sends traffic to pod IPs in "
                "127.0.0.0/8 only (pass --allow-remote to target other hosts)"
            )
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _body(tr: TraceRequest, model: str | None, chat: bool, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": tr.output_tokens, "ignore_eos": True, "stream": stream}
    if model:
        body["model"] = model
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(["hi"] * tr.prompt_tokens)}]
    else:
        # Token ids clear of special tokens in common vocabularies; the count is what matters.
        body["prompt"] = [1000 + (i % 1000) for i in range(tr.prompt_tokens)]
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(session: Any, url: str, tr: TraceRequest, model: str | None, chat: bool, stream: bool,
               rec: RequestRecord) -> None:  # fmt: skip
    import aiohttp

    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    rec.sent_at = t0
    try:
        async with session.post(url + path, json=_body(tr, model, chat, stream)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                rec.error = f"HTTP {resp.status}: {text[:120]}"
                return
            if not stream:
                doc = await resp.json()
                rec.e2e_s = time.perf_counter() - t0
                rec.output_tokens = int((doc.get("usage") or {}).get("completion_tokens", 0))
                rec.ok = True
                return
            last: float | None = None
            chunks = 0
            usage_tokens: int | None = None
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                docs, buf = sse_json_events(buf + data)
                for doc in docs:
                    if doc.get("usage"):
                        usage_tokens = int(doc["usage"].get("completion_tokens", 0))
                    choices = doc.get("choices") or []
                    if not choices:
                        continue
                    c = choices[0]
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if not text:
                        continue
                    chunks += 1
                    if last is None:
                        rec.ttft_s = now - t0
                    else:
                        rec.itls_s.append(now - last)
                    last = now
            rec.e2e_s = time.perf_counter() - t0
            rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
            rec.ok = rec.ttft_s is not None
            if not rec.ok:
                rec.error = "no content in the stream"
    except asyncio.CancelledError:
        rec.error = "incomplete"
        raise
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {str(exc)[:120]}"


def sse_json_events(buffer: bytes) -> tuple[list[Any], bytes]:
    """The JSON documents of the complete ``data: `` events in ``buffer`` (``[DONE]`` and other lines
    left out) and the unfinished tail to prepend to the next chunk.

    Raises:
        json.JSONDecodeError: an event whose data is not JSON.
    """
    *events, rest = buffer.split(b"\n\n")
    docs = [json.loads(ev[6:]) for ev in events if ev.startswith(b"data: ") and ev[6:] != b"[DONE]"]
    return docs, rest


async def _discover_model(session: Any, url: str) -> tuple[str | None, int | None]:
    """The first model's id and ``max_model_len`` (vLLM's ``/v1/models`` field) at ``url``, None where
    not given."""
    try:
        async with session.get(url + "/v1/models") as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                if data:
                    limit = data[0].get("max_model_len")
                    return str(data[0]["id"]), int(limit) if isinstance(limit, int) and limit > 1 else None
    except Exception:  # a server without /v1/models still takes requests without a model name
        return None, None
    return None, None


def clip_to_context(tr: TraceRequest, max_model_len: int | None) -> TraceRequest:
    """``tr`` with context + generated tokens ≤ ``max_model_len`` (the prompt shortened first, each part
    kept ≥ 1 token); ``tr`` itself when it fits or no limit is known."""
    if max_model_len is None or tr.prompt_tokens + tr.output_tokens <= max_model_len:
        return tr
    output = min(tr.output_tokens, max_model_len - 1)
    return TraceRequest(tr.offset_s, max(1, max_model_len - output), output)


async def run_load(
    urls: Sequence[str],
    trace: Sequence[TraceRequest],
    *,
    time_scale: float = 1.0,
    max_requests: int = 100,
    max_duration_s: float = 60.0,
    drain_s: float = 60.0,
    stream: bool = True,
    chat: bool = False,
    model: str | None = None,
    slo_ttft_ms: float | None = None,
    slo_itl_ms: float | None = None,
    allow_remote: bool = False,
    clip: bool = True,
) -> LoadResult:
    """Replay ``trace`` against ``urls`` (round-robin) and return what was measured; with ``clip``, rows
    longer than the smallest ``max_model_len`` the URLs give are shortened to it (:func:`clip_to_context`).
    The model sent is ``model``, else the first id a URL's ``/v1/models`` gives.

    Bounded: at most ``max_requests`` requests issued within ``max_duration_s`` s; whatever still runs
    ``drain_s`` s after the issuing window (``max_duration_s`` from the start, however soon the trace ran
    out) is cancelled (counted ``incomplete``). Total wall time ≤ max_duration_s + drain_s.

    Raises:
        LoadgenError: empty URL list or trace, a bound that is not a finite number in its range (naming
            the flag), non-loopback URL.
    """
    import aiohttp

    if not urls:
        raise LoadgenError("give at least one --url")
    if not trace:
        raise LoadgenError("the trace holds no requests")
    _check_bounds(time_scale, max_requests, max_duration_s, drain_s, slo_ttft_ms, slo_itl_ms)
    bases = [check_url(u, allow_remote) for u in urls]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        found = [await _discover_model(session, b) for b in bases]
        model = next((m for m, _ in found if m is not None), None) if model is None else model
        # Round-robin sends any row to any URL, so a row must fit the smallest limit among them.
        limits = [n for _, n in found if n is not None]
        max_len = min(limits) if clip and limits else None
        clipped = 0
        start = time.perf_counter()
        deadline = start + max_duration_s
        for i, tr in enumerate(trace[:max_requests]):
            due = start + tr.offset_s / time_scale
            if due >= deadline:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            url = bases[i % len(bases)]
            fitted = clip_to_context(tr, max_len)
            clipped += fitted is not tr
            tr = fitted
            rec = RequestRecord(
                url=url, prompt_tokens=tr.prompt_tokens, max_tokens=tr.output_tokens, sent_at=0.0
            )
            records.append(rec)
            tasks.append(asyncio.create_task(_one(session, url, tr, model, chat, stream, rec)))
        issued = len(tasks)
        issue_s = max(time.perf_counter() - start, max_duration_s if trace[issued:max_requests] else 0.0)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s + max(0.0, deadline - time.perf_counter()))
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    return summarize(
        records,
        urls=bases,
        stream=stream,
        time_scale=time_scale,
        duration_s=duration,
        issued=issued,
        slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=slo_itl_ms,
        issue_s=issue_s,
        clipped=clipped,
        max_model_len=max_len,
    )


def format_table(res: LoadResult) -> str:
    """A short human-readable report of ``res``."""
    lines = [
        f"requests: issued {res.issued}, completed {res.completed}, failed {res.failed}, "
        f"incomplete {res.incomplete} in {res.duration_s:.1f} s ({res.request_rate:.1f} req/s offered "
        f"over {res.issue_s:.1f} s)",
        f"throughput: {res.throughput_rps:.2f} req/s, {res.output_tokens_per_s:.0f} output tok/s",
        f"{'metric':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}  (ms)",
    ]
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        p = getattr(res, name)
        if p:
            lines.append(
                f"{name[:-3]:<8}{p['mean']:>10.1f}{p['p50']:>10.1f}{p['p90']:>10.1f}{p['p99']:>10.1f}"
            )
    if res.goodput_rps is not None:
        bounds = [f"{name} ≤ {v:g} ms" for name, v in (("TTFT", res.slo_ttft_ms), ("TPOT", res.slo_itl_ms))
                  if v is not None]  # fmt: skip
        lines.append(
            f"SLO ({', '.join(bounds)}): {res.slo_met}/{res.completed} met, "
            f"goodput {res.goodput_rps:.2f} req/s"
        )
    if res.clipped:
        lines.append(f"clipped {res.clipped} request(s) to the server's max_model_len {res.max_model_len}")
    for err, n in res.errors.items():
        lines.append(f"error x{n}: {err}")
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    """Add ``gearshift loadgen``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "loadgen",
        help="replay a CSV trace against OpenAI-compatible URLs; report TTFT/ITL/E2E and goodput",
        description="Replay a CSV trace against OpenAI-compatible URLs; report TTFT/ITL/E2E and goodput.",
        epilog="Exit status: 0 when every issued request completed; 1 when any failed or was still "
        "running after --drain (the report still counts them; --exit-zero makes this 0); 2 on bad input "
        "(a flag, the trace, a URL).",
    )
    p.add_argument("--url", action="append", required=True,
                   help="base URL (repeat, or comma-separate, for several pods; round-robin)")  # fmt: skip
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="CSV: TIMESTAMP,ContextTokens,GeneratedTokens (default: the bundled Azure LLM 2023 "
                   "conversation trace)")  # fmt: skip
    p.add_argument("--time-scale", type=finite_number(0, False, "a speed-up factor"), default=1.0,
                   help="divide arrival offsets by this (default 1)")  # fmt: skip
    p.add_argument("--max-requests", type=positive_int, default=100,
                   help="most requests to issue (default 100)")  # fmt: skip
    p.add_argument("--max-duration", type=finite_number(0, False, "seconds"), default=60.0,
                   help="most seconds to issue for (default 60)")  # fmt: skip
    p.add_argument("--drain", type=finite_number(0, True, "seconds"), default=60.0,
                   help="seconds to wait for requests after the --max-duration window (60)")  # fmt: skip
    p.add_argument("--stream", action="store_true", help="stream (needed for TTFT/ITL)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions with word prompts")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--slo-ttft-ms", type=finite_number(0, False, "ms"),
                   help="TTFT SLO for goodput, ms (with --stream; given alone, goodput checks TTFT "
                   "only)")  # fmt: skip
    p.add_argument("--slo-itl-ms", type=finite_number(0, False, "ms"),
                   help="per-token (TPOT) SLO for goodput, ms (with --stream; given alone, goodput checks "
                   "TPOT only)")  # fmt: skip
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback URLs")
    p.add_argument("--no-clip", dest="clip", action="store_false",
                   help="send rows longer than the servers' max_model_len as they are (the server refuses "
                   "them; default: shorten them to the smallest max_model_len of the URLs)")  # fmt: skip
    p.add_argument("--exit-zero", action="store_true",
                   help="exit 0 even when requests failed or were incomplete (for a benchmark that "
                   "reports them)")  # fmt: skip
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    """Run ``gearshift loadgen``; exit status as its ``--help`` says (0 all completed, 1 some did not, 2
    bad input)."""
    urls = [u for item in args.url for u in item.split(",") if u]
    if not args.stream and (args.slo_ttft_ms is not None or args.slo_itl_ms is not None):
        # TTFT and TPOT are measured on streams only; say so instead of printing no SLO line at all.
        print(
            "gearshift loadgen: warning: --slo-ttft-ms/--slo-itl-ms count only with --stream "
            "(TTFT and TPOT are measured on streams); no SLO is counted in this run",
            file=sys.stderr,
        )
    try:
        trace = load_trace(args.trace, limit=args.max_requests)
        res = asyncio.run(
            run_load(
                urls,
                trace,
                time_scale=args.time_scale,
                max_requests=args.max_requests,
                max_duration_s=args.max_duration,
                drain_s=args.drain,
                stream=args.stream,
                chat=args.chat,
                model=args.model,
                slo_ttft_ms=args.slo_ttft_ms,
                slo_itl_ms=args.slo_itl_ms,
                allow_remote=args.allow_remote,
                clip=args.clip,
            )
        )
    except (LoadgenError, TraceError, OSError) as exc:
        print(f"gearshift loadgen: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gearshift loadgen: interrupted; the run was cut short, no report", file=sys.stderr)
        return 130
    print(json.dumps(res.to_dict(), indent=2) if args.output == "json" else format_table(res))
    if res.completed == res.issued or args.exit_zero:
        return 0
    print(
        f"gearshift loadgen: {res.issued - res.completed} of {res.issued} requests did not complete "
        f"({res.failed} failed, {res.incomplete} incomplete); exit 1 (--exit-zero: 0)",
        file=sys.stderr,
    )
    return 1
