"""The load generator: trace parsing, URL guard, summary maths, and a small run against an in-process sim."""

from __future__ import annotations

import fnmatch
import itertools
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

import gearshift
from gearshift.dev.loadgen import (
    DEFAULT_TRACE,
    LoadgenError,
    RequestRecord,
    TraceRequest,
    check_url,
    clip_to_context,
    load_trace,
    run_load,
    summarize,
)
from gearshift.facts.model import load_hf_config
from gearshift.sim.config import config_from_env
from gearshift.sim.perfmodel import PerfModel, parse_pipeline
from gearshift.sim.server import build_app

REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / "examples" / "models" / "llama-3-8b.json"


class TestTrace:
    def test_azure_timestamps_become_offsets(self, tmp_path: Path) -> None:
        p = tmp_path / "t.csv"
        p.write_text(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,374,44\n"
            "2023-11-16 18:15:50.9951690,396,109\n"
            "2023-11-16 18:15:51.2224670,879,0\n"
        )
        tr = load_trace(p)
        assert [t.prompt_tokens for t in tr] == [374, 396, 879]
        assert tr[0].offset_s == 0.0
        assert tr[1].offset_s == pytest.approx(50.995169 - 46.68059, abs=1e-6)
        assert tr[2].output_tokens == 1  # a zero-length answer still asks for one token

    def test_the_bundled_trace_loads(self) -> None:
        tr = load_trace(DEFAULT_TRACE, limit=50)
        assert len(tr) == 50 and all(b.offset_s >= a.offset_s for a, b in itertools.pairwise(tr))

    def test_the_default_trace_is_package_data_whatever_the_cwd(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # From a directory with no ../shared (nor anything else of a checkout's surroundings) around it.
        monkeypatch.chdir(tmp_path)
        assert not Path("../shared").exists() and not Path("operator").exists()
        assert DEFAULT_TRACE.is_absolute()
        assert DEFAULT_TRACE.parent == Path(gearshift.__file__).resolve().parent / "data"
        # Rows counted apart from the loader: non-blank lines of the file, less the header.
        lines = [ln for ln in DEFAULT_TRACE.read_bytes().splitlines() if ln.strip()]
        assert lines[0].decode() == "TIMESTAMP,ContextTokens,GeneratedTokens"
        rows = len(lines) - 1
        assert rows == 19366  # the figure gearshift/data/README.md states
        tr = load_trace(DEFAULT_TRACE)
        assert len(tr) == rows
        assert tr[0].offset_s == 0.0 and tr[-1].offset_s == pytest.approx(3501.72, abs=0.01)
        assert sum(t.prompt_tokens for t in tr) / rows == pytest.approx(1154.7, abs=0.1)

    def test_every_default_trace_is_the_one_constant(self) -> None:
        import gearshift.dev.demo as demo
        from gearshift.cli import build_parser

        assert demo.DEFAULT_TRACE is DEFAULT_TRACE
        assert build_parser().parse_args(["demo"]).trace == DEFAULT_TRACE
        assert build_parser().parse_args(["loadgen", "--url", "http://127.0.0.1:1"]).trace == DEFAULT_TRACE

    def test_the_trace_and_its_readme_ship_as_package_data(self) -> None:
        # A plain (non-editable) ``pip install .`` copies only what package-data names.
        globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
        pkg = Path(gearshift.__file__).resolve().parent
        for f in (DEFAULT_TRACE, pkg / "data" / "README.md"):
            rel = f.relative_to(pkg).as_posix()
            assert f.is_file() and any(fnmatch.fnmatch(rel, g) for g in globs["gearshift"]), rel
        readme = (pkg / "data" / "README.md").read_text()
        for needed in ("Azure/AzurePublicDataset", "AzureLLMInferenceDataset2023", "CC BY 4.0", "Splitwise"):
            assert needed in readme

    def test_no_trace_path_outside_the_repository(self) -> None:
        # The trace once lived beside the checkout (in a sibling folder "shared") or at one machine's path.
        banned = ("shared" + "/traces", "/" + "work/")
        files = [REPO / "Makefile", REPO / "README.md"]
        for top in ("operator", "bench", "tests", "e2e"):
            files += sorted((REPO / top).rglob("*.py"))
        files += sorted((REPO / "bench" / "results").glob("*.json"))
        hits = [f"{f.relative_to(REPO)}: {b}" for f in files for b in banned if b in f.read_text()]
        assert hits == []

    def test_missing_column_is_named(self, tmp_path: Path) -> None:
        p = tmp_path / "t.csv"
        p.write_text("TIMESTAMP,ContextTokens\n1,2\n")
        with pytest.raises(LoadgenError, match="GeneratedTokens"):
            load_trace(p)


class TestUrl:
    def test_loopback_only_unless_allowed(self) -> None:
        assert check_url("http://127.0.3.4:8000/v1/") == "http://127.0.3.4:8000"
        assert check_url("http://localhost:80") == "http://localhost:80"
        for bad in ("http://10.0.0.1:8000", "http://192.168.1.2", "http://example.com"):
            with pytest.raises(LoadgenError, match="loopback"):
                check_url(bad)
        assert check_url("http://10.0.0.1:8000", allow_remote=True) == "http://10.0.0.1:8000"


class TestSummary:
    def rec(self, ttft: float, e2e: float, n: int, gaps: list[float]) -> RequestRecord:
        r = RequestRecord(url="u", prompt_tokens=1, max_tokens=n, sent_at=0.0, ok=True)
        r.ttft_s, r.e2e_s, r.output_tokens, r.itls_s = ttft, e2e, n, gaps
        return r

    def test_percentiles_goodput_and_failures(self) -> None:
        recs = [
            self.rec(0.100, 1.100, 11, [0.1] * 10),  # TPOT 100 ms: misses a 50 ms SLO
            self.rec(0.150, 0.550, 11, [0.04] * 10),  # TPOT 40 ms, TTFT 150: meets
            self.rec(0.300, 0.700, 11, [0.04] * 10),  # TTFT 300 ms: misses
        ]
        bad = RequestRecord(url="u", prompt_tokens=1, max_tokens=1, sent_at=0.0, error="HTTP 500: x")
        res = summarize([*recs, bad], urls=["u"], stream=True, time_scale=1, duration_s=2.0, issued=4,
                        slo_ttft_ms=200, slo_itl_ms=50)  # fmt: skip
        assert (res.completed, res.failed, res.slo_met) == (3, 1, 1)
        assert res.goodput_rps == pytest.approx(0.5)
        assert res.throughput_rps == pytest.approx(1.5)
        assert res.ttft_ms["p50"] == pytest.approx(150.0)
        assert res.tpot_ms["mean"] == pytest.approx((100 + 40 + 40) / 3)
        assert res.itl_ms["p99"] == pytest.approx(np.percentile([100] * 10 + [40] * 20, 99))
        assert res.errors == {"HTTP 500: x": 1}


class TestClipToContext:
    def test_the_prompt_is_shortened_first(self) -> None:
        assert clip_to_context(TraceRequest(1.5, 14_050, 30), 8192) == TraceRequest(1.5, 8162, 30)

    def test_a_fitting_row_or_no_limit_is_kept_as_it_is(self) -> None:
        tr = TraceRequest(0.0, 8000, 192)
        assert (
            clip_to_context(tr, 8192) is tr
            and clip_to_context(TraceRequest(0, 9000, 9), None).prompt_tokens == 9000
        )

    def test_an_output_alone_over_the_limit_leaves_one_prompt_token(self) -> None:
        assert clip_to_context(TraceRequest(0.0, 50, 9000), 8192) == TraceRequest(0.0, 1, 8191)


async def _sims(n: int) -> tuple[list[web.AppRunner], list[str]]:
    env = {
        "GEARSHIFT_MODEL": str(LLAMA),
        "GEARSHIFT_SERVED_MODEL_NAME": "llama",
        "GEARSHIFT_PIPELINE": json.dumps({"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}),
    }
    runners, urls = [], []
    for _ in range(n):
        runner = web.AppRunner(build_app(config_from_env(env)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    return runners, urls


async def test_a_row_over_the_served_context_is_clipped_not_failed() -> None:
    """The bundled trace's row 5442 (14,050 context tokens) is longer than Llama-3-8B's 8,192: the sim,
    as vLLM, refuses it with a 400 unless the replay shortens it (the demo reported it as 1 failed)."""
    runners, urls = await _sims(1)
    trace = [TraceRequest(0.0, 100, 3), TraceRequest(0.01, 14_050, 3)]
    try:
        res = await run_load(urls, trace, max_requests=2, max_duration_s=5, drain_s=20, stream=True)
        raw = await run_load(
            urls, trace, max_requests=2, max_duration_s=5, drain_s=20, stream=True, clip=False
        )
    finally:
        for r in runners:
            await r.cleanup()
    assert (res.completed, res.failed, res.clipped, res.max_model_len) == (2, 0, 1, 8192)
    assert sorted(r.prompt_tokens for r in res.records) == [100, 8192 - 3]
    assert (raw.completed, raw.failed, raw.clipped) == (1, 1, 0)
    assert [r.status for r in raw.records if not r.ok] == [400]


async def test_run_against_in_process_sims_measures_on_the_wire() -> None:
    runners, urls = await _sims(2)
    try:
        trace = [TraceRequest(0.05 * i, 200, 4) for i in range(6)]
        res = await run_load(urls, trace, time_scale=1.0, max_requests=5, max_duration_s=5, drain_s=10,
                             stream=True, slo_ttft_ms=10_000, slo_itl_ms=10_000)  # fmt: skip
    finally:
        for r in runners:
            await r.cleanup()
    assert (res.issued, res.completed, res.failed) == (5, 5, 0)
    assert {r.url for r in res.records} == set(urls)  # round-robin over both pods
    arch = load_hf_config(LLAMA)
    model = PerfModel(arch, parse_pipeline({"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}, arch))
    # Client-side TTFT can only be longer than the modelled prefill (HTTP on top).
    assert min(r.ttft_s for r in res.records) >= model.prefill_time_s(200)
    assert all(r.output_tokens == 4 and len(r.itls_s) == 3 for r in res.records)
    assert res.slo_met == 5


async def test_bounds_are_checked() -> None:
    with pytest.raises(LoadgenError):
        await run_load([], [TraceRequest(0, 1, 1)])
    with pytest.raises(LoadgenError, match="loopback"):
        await run_load(["http://10.1.2.3:8000"], [TraceRequest(0, 1, 1)])
