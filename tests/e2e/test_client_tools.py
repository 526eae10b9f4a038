"""Standard LLM benchmark clients against the PD router: guidellm, aiperf and inference-perf, briefly.

Each tool runs as its users run it, from a venv outside the repository
(``e2e/sandbox/install-bench-tools.sh``, versions in ``e2e/sandbox/versions.env``), against the router's
OpenAI URL (the router pod's loopback IP), with the sandbox tiny model's tokenizer built locally
(``e2e/sandbox/build_tiny_model.py``): no model hub is reached (``HF_HUB_OFFLINE=1``, and ``HF_ENDPOINT``
on a closed loopback port for anything that still tries). The router serves a PDService of engine
``sim`` (one A10 prefill pod, one T4 decode pod, policy ``pd-score``), run by the operator as a
subprocess on this module's namespace, as in test_router.py.

Each tool sends :data:`N_REQUESTS` streamed requests one at a time (concurrency 1), synthetic prompts of
:data:`PROMPT_TOKENS` tokens of that tokenizer and :data:`OUTPUT_TOKENS` output tokens (``ignore_eos``).
guidellm speaks ``/v1/chat/completions`` (its default), aiperf and inference-perf ``/v1/completions``.
The test reads the tool's own result file and the router's ``/metrics`` before and after, and asserts:

- the run completed :data:`N_REQUESTS` requests with 0 errors (guidellm may leave its last one out of its
  report, :attr:`ClientRun.unrecorded`; the router must still count it);
- the router counted the same requests (``vllm:request_success_total``, and a first token for each in
  ``vllm:time_to_first_token_seconds``) and the same tokens as the tool (``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``; :data:`OUTPUT_TOKENS` per request). Token counts are the server's:
  the simulated engine counts one token per word and answers ``" tok"`` words, which the local BPE
  tokenizer splits differently, so every tool is told to use the answer's ``usage`` (guidellm does so by
  default); the tokenizer only sizes the synthetic prompts;
- the mean TTFT and E2E latency agree: the client's are larger by the same offset, its own time per
  request (the bounds and why: :data:`OFFSET_AGREE_S`).

Concurrency 1 keeps the comparison about the router: with its own requests overlapping, a client's
Python process on the 2 shared cores adds its own delays to every TTFT (measured with guidellm at
4 req/s: +13 ms on a 30 ms mean, against +3 ms one at a time).

``GEARSHIFT_TOOLS_ROUTER=http://127.x.y.z:port`` runs the tools against a router already up (e.g.
``gearshift-router --backend ...`` over ``gearshift-sim`` pods on loopback) and makes no sandbox objects.
inference-perf needs Python >= 3.12: where the install script found none, its test is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    serving_router_url,
    teardown_run,
)
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "e2e" / "sandbox" / "install-bench-tools.sh"
#: A router already up to test instead of the sandbox's (loopback URLs only).
ROUTER_ENV = "GEARSHIFT_TOOLS_ROUTER"
#: Skips the tests where the clients are not installed (otherwise that is a failure, as in CI).
SKIP_ENV = "GEARSHIFT_SKIP_BENCH_TOOLS"

SERVICE = "ct"
MODEL = LLAMA_3_2_1B
N_REQUESTS = 30
#: Tokens of the local tokenizer per synthetic prompt (about 16 words, which the simulated engine counts).
PROMPT_TOKENS = 64
#: Not 16: a request whose client dropped ``max_tokens`` would get OpenAI's default of 16 and still pass.
OUTPUT_TOKENS = 12
#: Hard limit on one tool's run (start-up included: guidellm takes ~25 s before its first request).
TOOL_TIMEOUT_S = 300
#: Per-request limit the tools are given (a healthy request here takes under a second).
REQUEST_TIMEOUT_S = 60

#: How the client's mean TTFT and E2E latency must relate to the router's. The client's window holds the
#: router's (it starts before the request is sent and ends after the event is read), so its means can only
#: be the larger ones, less :data:`CLOCK_SLACK_S` for the two clocks. What it adds is its own time per
#: request: the loopback hop each way, its HTTP stack and parser, and above all its process's turns on the
#: 2 shared cores: a few ms whatever the TTFT, not a fraction of it, and as large as the machine is loaded
#: (measured at concurrency 1 on ~30-50 ms router means: +2-5 ms at load average 2, +8-25 ms at load
#: average 10, where a 20 % bound failed). That offset is the same in TTFT and E2E (measured: within
#: 1.2 ms in every run), since both intervals start at the request and end at an event's arrival: so the
#: offset seen in TTFT must match the one seen in E2E within :data:`OFFSET_AGREE_S`, whatever the load.
#: That catches a router TTFT ending at another event than the client's first token (a role chunk, a
#: later chunk) or in other units; :data:`MAX_OFFSET_REL` and :data:`MAX_OFFSET_S` bound the offset itself
#: (a router clock that starts late in both), loosely, for the loaded case.
CLOCK_SLACK_S = 0.001
OFFSET_AGREE_S = 0.005
MAX_OFFSET_REL = 1.0
MAX_OFFSET_S = 0.020


# --- the tools -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchTools:
    """What ``install-bench-tools.sh --print`` names: each tool's venv ``bin`` and the local tokenizer as
    an HF_HOME holding the hub repo ``tokenizer_id`` (its snapshot directory: ``tokenizer``)."""

    bins: dict[str, Path]
    hf_home: Path
    tokenizer_id: str
    tokenizer: Path


def bench_tools() -> BenchTools:
    """The installed clients; fails (skips with GEARSHIFT_SKIP_BENCH_TOOLS=1) where guidellm and aiperf
    or the tokenizer are missing."""
    out = subprocess.run(["bash", str(INSTALL), "--print"], capture_output=True, text=True, check=True)
    found = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    missing = [k for k in ("guidellm", "aiperf", "hf_home", "tokenizer_id", "tokenizer") if k not in found]
    if missing:
        msg = (
            f"benchmark clients not installed ({', '.join(missing)} missing): run "
            f"`bash e2e/sandbox/install-bench-tools.sh` (CI does); {SKIP_ENV}=1 skips these tests"
        )
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(msg)
        pytest.fail(msg)
    names: tuple[str, ...] = ("guidellm", "aiperf", "inference-perf")
    bins = {k: Path(found[k]) for k in names if k in found}
    return BenchTools(bins, Path(found["hf_home"]), found["tokenizer_id"], Path(found["tokenizer"]))


def tool_env(tools: BenchTools) -> dict[str, str]:
    """The tools' environment: no hub (offline; a hub call that is still made goes to a closed loopback
    port, not out), no proxy between them and the loopback router, the local tokenizer's HF_HOME."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.pop("HF_TOKEN", None)
    env.update(
        HF_HOME=str(tools.hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.0/8,localhost",
        no_proxy="127.0.0.0/8,localhost",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_tool(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
    """Run one tool to its end, within :data:`TOOL_TIMEOUT_S` s; its output goes to ``log``. The tools
    start worker processes, so the run is a process group of its own, killed whole on a timeout.

    Raises:
        AssertionError: it exited non-zero or ran out of time (with the tail of its output).
    """
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=TOOL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            rc = None
    tail = log.read_text(errors="replace")[-4000:]
    if rc is None:
        raise AssertionError(f"`{' '.join(argv)}` ran over {TOOL_TIMEOUT_S} s; output (tail):\n{tail}")
    if rc != 0:
        raise AssertionError(f"`{' '.join(argv)}` exited {rc}; output (tail):\n{tail}")


@dataclass(frozen=True)
class ClientRun:
    """One tool's run as its own result file tells it: requests completed and errored, mean TTFT and E2E
    latency (s), and the prompt and output tokens of the completed requests (the server's ``usage``)."""

    completed: int
    errored: int
    ttft_mean_s: float
    e2e_mean_s: float
    prompt_tokens: int
    output_tokens: int
    unrecorded: int = 0
    """Requests the tool sent but left out of its report: guidellm's scheduler may end its benchmark with
    its last request still ``processing`` (its ``scheduler_state``; seen once on 2 loaded cores, 29 of 30
    reported while the router answered all 30 with 200)."""


def guidellm_argv(bin_dir: Path, url: str, model: str, tokenizer: Path, out: Path) -> list[str]:
    """``guidellm run``: synchronous (one request at a time), chat, synthetic text, JSON report ``out``."""
    backend = (
        f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions,"
        f"http2=false,timeout={REQUEST_TIMEOUT_S}"
    )
    return [
        str(bin_dir / "guidellm"), "run",
        "--backend", backend,
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={N_REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip


def read_guidellm(path: Path) -> ClientRun:
    """guidellm's JSON report (one benchmark): ``metrics.*.successful`` (TTFT in ms, latency in s)."""
    bench = json.loads(path.read_text())["benchmarks"]
    assert len(bench) == 1, f"{path}: {len(bench)} benchmarks, expected one"
    m = bench[0]["metrics"]
    totals = m["request_totals"]
    state = bench[0].get("scheduler_state") or {}
    return ClientRun(
        completed=int(totals["successful"]),
        errored=int(totals["errored"]) + int(totals["incomplete"]),
        ttft_mean_s=m["time_to_first_token_ms"]["successful"]["mean"] / 1000,
        e2e_mean_s=m["request_latency"]["successful"]["mean"],
        prompt_tokens=round(m["prompt_token_count"]["successful"]["total_sum"]),
        output_tokens=round(m["output_token_count"]["successful"]["total_sum"]),
        unrecorded=int(state.get("processing_requests") or 0),
    )


def aiperf_argv(bin_dir: Path, url: str, model: str, tokenizer_id: str, out: Path) -> list[str]:
    """``aiperf profile``: concurrency 1, completions, synthetic prompts, server token counts, artifacts
    in ``out``. The tokenizer is given by its hub id: aiperf 0.13 offline resolves only ids (from
    HF_HOME), a local path fails its offline lookup."""
    return [
        str(bin_dir / "aiperf"), "profile",
        "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
        "--tokenizer", tokenizer_id,
        "--isl", str(PROMPT_TOKENS), "--osl", str(OUTPUT_TOKENS),
        "--extra-inputs", "ignore_eos:true",
        "--concurrency", "1", "--request-count", str(N_REQUESTS), "--random-seed", "1",
        "--use-server-token-count",
        "--request-timeout-seconds", str(REQUEST_TIMEOUT_S),
        "--artifact-dir", str(out),
        "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
    ]  # fmt: skip


def read_aiperf(out: Path) -> ClientRun:
    """aiperf's ``profile_export_aiperf.json``: metrics as ``{unit, avg, ...}`` (times in ms)."""
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    assert doc["is_complete"] and not doc["was_cancelled"], (
        f"aiperf run not complete: {doc.get('error_summary')}"
    )
    # Two views of the same failures: the count metric (absent with none) and the summary by error.
    errored = max(
        int(doc.get("error_request_count", {}).get("avg", 0)),
        sum(int(e.get("count", 1)) for e in doc.get("error_summary") or []),
    )
    return ClientRun(
        completed=int(doc["request_count"]["avg"]),
        errored=errored,
        ttft_mean_s=doc["time_to_first_token"]["avg"] / 1000,
        e2e_mean_s=doc["request_latency"]["avg"] / 1000,
        prompt_tokens=round(doc["total_usage_prompt_tokens"]["avg"]),
        output_tokens=round(doc["total_usage_completion_tokens"]["avg"]),
    )


def inference_perf_config(url: str, model: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    """inference-perf's config: one concurrent stage (concurrency 1), completions, ``synthetic`` data,
    server output token counts. Not ``random``: it decodes random token ids and needs the text to
    re-encode to exactly :data:`PROMPT_TOKENS`; with this tokenizer it gave up on 1 request of 30 and
    reported 29 successes and no failure."""

    def fixed(n: int) -> dict[str, int]:
        return {"min": n, "max": n, "mean": n, "std_dev": 0, "total_count": N_REQUESTS}

    return {
        "api": {"type": "completion", "streaming": True},
        "data": {
            "type": "synthetic",
            "input_distribution": fixed(PROMPT_TOKENS),
            "output_distribution": fixed(OUTPUT_TOKENS),
        },
        "load": {
            "type": "concurrent",
            "stages": [{"num_requests": N_REQUESTS, "concurrency_level": 1}],
            "num_workers": 1,
            "base_seed": 1,
            "request_timeout": REQUEST_TIMEOUT_S,
        },
        "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "report": {
            "request_lifecycle": {"summary": True, "per_stage": False, "use_server_output_tokens": True}
        },
        "storage": {"local_storage": {"path": str(out)}},
    }


def read_inference_perf(out: Path) -> ClientRun:
    """inference-perf's ``summary_lifecycle_metrics.json`` (times in s)."""
    doc = json.loads((out / "summary_lifecycle_metrics.json").read_text())
    ok = doc["successes"]
    return ClientRun(
        completed=int(ok["count"]),
        errored=int(doc["failures"]["count"]),
        ttft_mean_s=ok["latency"]["time_to_first_token"]["mean"],
        e2e_mean_s=ok["latency"]["request_latency"]["mean"],
        prompt_tokens=round(ok["prompt_tokens"]["total"]),
        output_tokens=round(ok["output_tokens"]["total"]),
    )


# --- the router's side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterCounters:
    """The router's client-facing counters for one model (vLLM's names), and its requests by outcome."""

    success: float = 0.0
    ttft_count: float = 0.0
    ttft_sum_s: float = 0.0
    e2e_count: float = 0.0
    e2e_sum_s: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    inflight: float = 0.0
    outcomes: dict[str, float] = field(default_factory=dict)

    def since(self, before: RouterCounters) -> RouterCounters:
        """The counts added since ``before`` (the gauge ``inflight`` as it is now)."""
        keys = set(self.outcomes) | set(before.outcomes)
        return replace(
            self,
            success=self.success - before.success,
            ttft_count=self.ttft_count - before.ttft_count,
            ttft_sum_s=self.ttft_sum_s - before.ttft_sum_s,
            e2e_count=self.e2e_count - before.e2e_count,
            e2e_sum_s=self.e2e_sum_s - before.e2e_sum_s,
            prompt_tokens=self.prompt_tokens - before.prompt_tokens,
            generation_tokens=self.generation_tokens - before.generation_tokens,
            outcomes={k: self.outcomes.get(k, 0.0) - before.outcomes.get(k, 0.0) for k in keys},
        )


#: Sample name -> RouterCounters field, for samples labelled with the model.
_SAMPLES = {
    "vllm:request_success_total": "success",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum_s",
    "vllm:e2e_request_latency_seconds_count": "e2e_count",
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum_s",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
}


def parse_router_metrics(text: str, model: str) -> RouterCounters:
    """The router's ``/metrics`` text as :class:`RouterCounters` for ``model`` (summed over other labels,
    e.g. ``finished_reason``)."""
    values = dict.fromkeys(_SAMPLES.values(), 0.0)
    outcomes: dict[str, float] = {}
    inflight = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _SAMPLES and s.labels.get("model_name") == model:
                values[_SAMPLES[s.name]] += s.value
            elif s.name == "gearshift_router_requests_total":
                outcomes[s.labels["outcome"]] = outcomes.get(s.labels["outcome"], 0.0) + s.value
            elif s.name == "gearshift_router_inflight":
                inflight = s.value
    return RouterCounters(**values, inflight=inflight, outcomes=outcomes)


def _get(url: str, timeout: float = 5.0) -> str:
    assert (urllib.parse.urlparse(url).hostname or "").startswith("127."), url  # loopback only
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def router_counters(url: str, model: str) -> RouterCounters:
    """Scrape the router's ``/metrics``."""
    return parse_router_metrics(_get(url + "/metrics"), model)


def settled_counters(wait_for: Callable[..., Any], url: str, model: str) -> RouterCounters:
    """The router's counters once nothing is in flight (the tool's last answers recorded)."""
    counters: RouterCounters = wait_for(
        lambda: (c := router_counters(url, model)).inflight == 0 and c, 15, "the router's in-flight to drain"
    )
    return counters


def assert_agree(tool: str, run: ClientRun, router: RouterCounters) -> None:
    """The tool's run and the router's counts over the same run agree (module docstring)."""
    assert run.errored == 0 and run.unrecorded <= 1, f"{tool}: {run}"
    assert run.completed + run.unrecorded == N_REQUESTS, f"{tool}: {run}"
    seen = f"{tool}: {run}; the router over the run: {router}"
    assert router.success == N_REQUESTS, (
        f"the router counted {router.success:g} of {tool}'s {N_REQUESTS} requests as successful; "
        f"its requests by outcome: {router.outcomes}\n{seen}"
    )
    assert router.ttft_count == N_REQUESTS and router.e2e_count == N_REQUESTS, seen
    assert router.generation_tokens == OUTPUT_TOKENS * N_REQUESTS, seen
    assert run.output_tokens == OUTPUT_TOKENS * run.completed, seen
    if run.unrecorded:  # the router also counted the prompt the tool left out: about one request's worth
        per_request = run.prompt_tokens / run.completed
        assert 0 < router.prompt_tokens - run.prompt_tokens <= 2 * per_request * run.unrecorded, seen
    else:
        assert router.prompt_tokens == run.prompt_tokens, seen
    ttft = router.ttft_sum_s / router.ttft_count
    e2e = router.e2e_sum_s / router.e2e_count
    ttft_offset, e2e_offset = run.ttft_mean_s - ttft, run.e2e_mean_s - e2e
    print(
        f"{tool}: mean TTFT {run.ttft_mean_s * 1000:.1f} ms (router {ttft * 1000:.1f} ms, "
        f"{ttft_offset * 1000:+.1f}), mean E2E {run.e2e_mean_s * 1000:.1f} ms (router {e2e * 1000:.1f} ms, "
        f"{e2e_offset * 1000:+.1f})"
    )
    timing = f"client - router: mean TTFT {ttft_offset * 1000:.1f} ms, E2E {e2e_offset * 1000:.1f} ms; {seen}"
    assert ttft_offset >= -CLOCK_SLACK_S, timing
    assert abs(ttft_offset - e2e_offset) <= OFFSET_AGREE_S, timing
    assert ttft_offset <= MAX_OFFSET_REL * ttft + MAX_OFFSET_S, timing


# --- fixtures ------------------------------------------------------------------------------------------
def manifests(ns: str, prefill_node: str, decode_node: str) -> list[dict[str, Any]]:
    """One-stage GearSets pinned to the test's two nodes (an A10 prefill, a T4 decode) and the PDService."""

    def gearset(role: str, gear: str, node: str, gpu: str) -> dict[str, Any]:
        stage = {"layers": [0, MODEL["numLayers"]], "nodes": [node], "gpuModel": gpu}
        return build.gearset(f"{SERVICE}-{role}", ns, {
            "serviceName": SERVICE,
            "role": role,
            "mode": "explicit",
            "gears": [{"name": gear, "intent": "balanced", "microBatch": 4, "maxBatch": 64,
                       "stages": [stage]}],
        })  # fmt: skip

    pds = build.pdservice(SERVICE, ns, {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": f"{SERVICE}-prefill"}},
        "decode": {"gearSetRef": {"name": f"{SERVICE}-decode"}},
        "slo": {"ttftMs": 200, "itlMs": 50},
        "router": {"policy": "pd-score"},
    })  # fmt: skip
    return [
        gearset("prefill", "p", prefill_node, "A10-24GB"),
        gearset("decode", "d", decode_node, "T4-16GB"),
        pds,
    ]


@dataclass(frozen=True)
class Router:
    """The router under test: its base URL (loopback) and the model it serves."""

    url: str
    model: str


def _served_model(url: str) -> str:
    return str(json.loads(_get(url + "/v1/models"))["data"][0]["id"])


@pytest.fixture(scope="module")
def tools() -> BenchTools:
    """The installed clients (each test takes it before ``router``: a missing install fails before any
    sandbox work)."""
    return bench_tools()


@pytest.fixture(scope="module")
def router(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """The router pod of a sim PDService on the sandbox, or the router named by GEARSHIFT_TOOLS_ROUTER."""
    if url := os.environ.get(ROUTER_ENV):
        url = url.rstrip("/")
        assert (urllib.parse.urlparse(url).hostname or "").startswith("127."), (
            f"{ROUTER_ENV}={url}: loopback only"
        )
        yield Router(url, _served_model(url))
        return
    sandbox = request.getfixturevalue("sandbox")
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (loopback pod IPs run by the sandbox pod runner)")
    ns = f"e2e-tools-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    gpus = GpuNodes(sandbox, "e2e-ct", cidr_base=50)
    op: OperatorProcess | None = None
    try:
        prefill, decode = gpus.add("A10-24GB", "p"), gpus.add("T4-16GB", "d")
        op = OperatorProcess(sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log")
        sandbox.apply(manifests(ns, prefill, decode))
        running = op
        url = serving_router_url(
            sandbox, ns, SERVICE, 2, lambda: f"operator log (tail):\n{running.log_tail(3000)}"
        )

        def routable() -> dict[str, int] | None:
            counts: dict[str, int] = json.loads(_get(url + "/health"))["routable"]
            return counts if counts["prefill"] >= 1 and counts["decode"] >= 1 else None

        sandbox.wait_for(routable, 60, "the router to route to a prefill and a decode pod")
        yield Router(url, _served_model(url))
    finally:
        left = teardown_run(sandbox, ns, op, gpus)
        assert left == [], f"teardown left {left}"


# --- tests ---------------------------------------------------------------------------------------------
def test_guidellm(tools: BenchTools, router: Router, tmp_path: Path, wait_for: Callable[..., Any]) -> None:
    before = router_counters(router.url, router.model)
    report = tmp_path / "guidellm.json"
    argv = guidellm_argv(tools.bins["guidellm"], router.url, router.model, tools.tokenizer, report)
    run_tool(argv, tool_env(tools), tmp_path, tmp_path / "guidellm.log")
    after = settled_counters(wait_for, router.url, router.model)
    assert_agree("guidellm", read_guidellm(report), after.since(before))


def test_aiperf(tools: BenchTools, router: Router, tmp_path: Path, wait_for: Callable[..., Any]) -> None:
    before = router_counters(router.url, router.model)
    out = tmp_path / "aiperf"
    argv = aiperf_argv(tools.bins["aiperf"], router.url, router.model, tools.tokenizer_id, out)
    run_tool(argv, tool_env(tools), tmp_path, tmp_path / "aiperf.log")
    after = settled_counters(wait_for, router.url, router.model)
    assert_agree("aiperf", read_aiperf(out), after.since(before))


def test_inference_perf(
    tools: BenchTools, router: Router, tmp_path: Path, wait_for: Callable[..., Any]
) -> None:
    if "inference-perf" not in tools.bins:
        pytest.skip("inference-perf needs Python >= 3.12; install-bench-tools.sh found none on this machine")
    before = router_counters(router.url, router.model)
    out = tmp_path / "inference-perf"
    config = tmp_path / "inference-perf.yaml"
    config.write_text(yaml.safe_dump(inference_perf_config(router.url, router.model, tools.tokenizer, out)))
    argv = [str(tools.bins["inference-perf"] / "inference-perf"), "-c", str(config)]
    run_tool(argv, tool_env(tools), tmp_path, tmp_path / "inference-perf.log")
    after = settled_counters(wait_for, router.url, router.model)
    assert_agree("inference-perf", read_inference_perf(out), after.since(before))
