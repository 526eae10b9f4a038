"""The load generator: trace parsing, URL guard, summary maths, and a small run against an in-process sim."""

from __future__ import annotations

import fnmatch
import itertools
import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

import gearshift
from gearshift.dev.loadgen import (
    DEFAULT_TRACE,
    LoadgenError,
    LoadResult,
    RequestRecord,
    TraceError,
    TraceRequest,
    check_url,
    clip_to_context,
    format_table,
    load_trace,
    run_load,
    summarize,
)
from gearshift.facts.model import load_hf_config
from gearshift.sim.app import build_app
from gearshift.sim.config import config_from_env
from gearshift.sim.perfmodel import PerfModel, parse_pipeline

REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / "examples" / "models" / "llama-3-8b.json"


class TestTrace:
    def test_azure_timestamps_become_offsets(self, tmp_path: Path) -> None:
        p = tmp_path / "t.csv"
        p.write_text(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,374,44\n"
            "2023-11-16 18:15:50.9951690,396,109\n"
            "2023-11-16 18:15:51.2224670,879,1\n"
        )
        tr = load_trace(p)
        assert [t.prompt_tokens for t in tr] == [374, 396, 879]
        assert tr[0].offset_s == 0.0
        assert tr[1].offset_s == pytest.approx(50.995169 - 46.68059, abs=1e-6)
        assert tr[2].output_tokens == 1

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
        with pytest.raises(TraceError, match="GeneratedTokens"):
            load_trace(p)


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


class TestTraceRowsAreChecked:
    """A bad row is refused naming the file and its line (the CLI prints it on one line, exit 2): a short
    row and a non-UTF-8 file raised a traceback, token counts ≤ 0 were turned into 1, NaN timestamps
    passed."""

    def write(self, tmp_path: Path, body: str | bytes) -> Path:
        p = tmp_path / "t.csv"
        if isinstance(body, bytes):
            p.write_bytes(HEADER.encode() + body)
        else:
            p.write_text(HEADER + body)
        return p

    @pytest.mark.parametrize(
        ("rows", "match"),
        [
            ("1,10,5\n2,10\n", r"line 3: the row has 2 of the header's 3 cells, no GeneratedTokens"),
            ("1,10,5\n2\n", r"line 3: .* no ContextTokens, GeneratedTokens"),
            ("1,0,5\n", r"line 2: ContextTokens is 0; .*at least 1 token"),
            ("1,-4,5\n", r"line 2: ContextTokens is -4"),
            ("1,10,0\n", r"line 2: GeneratedTokens is 0; .*max_tokens 0"),
            ("1,10,5\n2,10,-1\n", r"line 3: GeneratedTokens is -1"),
            ("1,10,2.5\n", r"line 2: GeneratedTokens '2.5' is not a whole number"),
            ("nan,10,5\n", r"line 2: TIMESTAMP 'nan' is not a finite number"),
            ("1,10,5\ninf,10,5\n", r"line 3: TIMESTAMP 'inf' is not a finite number"),
            ("1,10,5\n-Infinity,10,5\n", r"line 3: TIMESTAMP '-Infinity'"),
            ("yesterday,10,5\n", r"line 2: TIMESTAMP 'yesterday' is neither an ISO date-time nor"),
        ],
    )
    def test_a_bad_row_is_named(self, tmp_path: Path, rows: str, match: str) -> None:
        p = self.write(tmp_path, rows)
        with pytest.raises(TraceError, match=match) as info:
            load_trace(p)
        assert str(info.value).startswith(f"{p} line ")

    def test_a_non_utf8_file_is_named_with_its_line(self, tmp_path: Path) -> None:
        p = self.write(tmp_path, b"1,10,5\n2,1\xff0,5\n")
        with pytest.raises(TraceError, match=r"line 3: not UTF-8 text \(byte 0xff\)"):
            load_trace(p)

    def test_a_byte_order_mark_is_not_part_of_the_header(self, tmp_path: Path) -> None:
        p = tmp_path / "t.csv"
        p.write_bytes(b"\xef\xbb\xbf" + HEADER.encode() + b"1,10,5\n")
        assert load_trace(p) == [TraceRequest(0.0, 10, 5)]

    @pytest.mark.parametrize(
        ("rows", "line"),
        [("1,10,5\n2,10\n", "line 3"), ("1,0,5\n", "line 2"), ("nan,1,1\n", "line 2")],
    )
    def test_the_cli_prints_one_line_and_exits_2(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: str, line: str
    ) -> None:
        from gearshift.cli import main

        p = self.write(tmp_path, rows)
        assert main(["loadgen", "--url", "http://127.0.0.1:1", "--trace", str(p)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"gearshift loadgen: {p} {line}: ") and err.count("\n") == 1, err
        assert "Traceback" not in err

    def test_unsorted_rows_are_sorted_then_limited(self, tmp_path: Path) -> None:
        """Offsets are from the earliest row, not the first, and ``limit`` keeps the earliest rows: the
        limit was applied to the file's order before sorting, and offsets were relative to row 1."""
        p = self.write(tmp_path, "10,1,1\n5,2,2\n20,3,3\n7,4,4\n")
        assert load_trace(p) == [
            TraceRequest(0.0, 2, 2),
            TraceRequest(2.0, 4, 4),
            TraceRequest(5.0, 1, 1),
            TraceRequest(15.0, 3, 3),
        ]
        assert [t.prompt_tokens for t in load_trace(p, limit=2)] == [2, 4]
        iso = self.write(tmp_path, "2023-11-16 18:15:50.5,1,1\n2023-11-16 18:15:46.5,2,2\n")
        assert load_trace(iso, limit=1) == [TraceRequest(0.0, 2, 2)]


class TestFlags:
    """Numeric flags refuse NaN, infinity and out-of-range values naming the flag (argparse's exit 2)."""

    @pytest.mark.parametrize(
        ("flag", "value"),
        [
            ("--time-scale", "nan"), ("--time-scale", "inf"), ("--time-scale", "0"),
            ("--max-duration", "inf"), ("--max-duration", "-1"), ("--max-duration", "NaN"),
            ("--drain", "-1"), ("--drain", "nan"), ("--drain", "inf"),
            ("--slo-ttft-ms", "nan"), ("--slo-ttft-ms", "0"), ("--slo-itl-ms", "inf"),
            ("--max-requests", "0"), ("--max-requests", "1.5"), ("--time-scale", "fast"),
        ],
    )  # fmt: skip
    def test_a_bad_value_is_refused_naming_the_flag(
        self, capsys: pytest.CaptureFixture[str], flag: str, value: str
    ) -> None:
        from gearshift.cli import build_parser

        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["loadgen", "--url", "http://127.0.0.1:1", f"{flag}={value}"])
        assert info.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument {flag}: {value!r}" in last, last

    def test_drain_0_and_good_values_pass(self) -> None:
        from gearshift.cli import build_parser

        args = build_parser().parse_args(
            ["loadgen", "--url", "http://127.0.0.1:1", "--drain", "0", "--time-scale", "2.5"]
        )
        assert (args.drain, args.time_scale) == (0.0, 2.5)

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"drain_s": -1.0}, r"--drain must be a finite number of seconds, 0 or more, got -1"),
            ({"drain_s": float("inf")}, r"--drain"),
            ({"time_scale": float("nan")}, r"--time-scale must be a finite number above 0, got nan"),
            ({"max_duration_s": float("inf")}, r"--max-duration"),
            ({"slo_ttft_ms": float("nan")}, r"--slo-ttft-ms"),
            ({"max_requests": 0}, r"--max-requests must be at least 1"),
        ],
    )
    async def test_run_load_names_the_bound(self, kwargs: dict[str, Any], match: str) -> None:
        with pytest.raises(LoadgenError, match=match):
            await run_load(["http://127.0.0.1:1"], [TraceRequest(0, 1, 1)], **kwargs)


class TestExitStatus:
    """``gearshift loadgen`` exited 0 whenever one request completed, however many failed."""

    def result(self, ok: int, failed: int, incomplete: int = 0) -> LoadResult:
        recs = [
            RequestRecord(url="u", prompt_tokens=1, max_tokens=1, sent_at=0.0, ok=True) for _ in range(ok)
        ]
        recs += [
            RequestRecord(url="u", prompt_tokens=1, max_tokens=1, sent_at=0.0, error="HTTP 500: x")
            for _ in range(failed)
        ]
        recs += [
            RequestRecord(url="u", prompt_tokens=1, max_tokens=1, sent_at=0.0, error="incomplete")
            for _ in range(incomplete)
        ]
        return summarize(recs, urls=["u"], stream=False, time_scale=1, duration_s=1.0, issued=len(recs),
                         slo_ttft_ms=None, slo_itl_ms=None)  # fmt: skip

    @pytest.mark.parametrize(
        ("ok", "failed", "incomplete", "extra", "code"),
        [
            (3, 0, 0, [], 0),
            (3, 1, 0, [], 1),
            (3, 0, 1, [], 1),
            (0, 2, 0, [], 1),
            (3, 1, 1, ["--exit-zero"], 0),
        ],
    )
    def test_failures_exit_1_unless_exit_zero(
        self,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        ok: int,
        failed: int,
        incomplete: int,
        extra: list[str],
        code: int,
    ) -> None:
        import gearshift.dev.loadgen as lg
        from gearshift.cli import main

        res = self.result(ok, failed, incomplete)

        async def fake_run_load(*_a: Any, **_k: Any) -> LoadResult:
            return res

        monkeypatch.setattr(lg, "run_load", fake_run_load)
        assert main(["loadgen", "--url", "http://127.0.0.1:1", "-o", "json", *extra]) == code
        out = capsys.readouterr()
        assert json.loads(out.out)["failed"] == failed  # the report is printed either way
        if code:
            assert out.err.count("\n") == 1 and f"of {ok + failed + incomplete} requests did not" in out.err


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

    def test_a_one_sided_slo_is_applied(self) -> None:
        """Only a TTFT or only a TPOT bound: goodput counts the requests that meet it (it was None)."""
        recs = [
            self.rec(0.100, 1.100, 11, [0.1] * 10),  # TTFT 100 ms, TPOT 100 ms
            self.rec(0.150, 0.550, 11, [0.04] * 10),  # TTFT 150 ms, TPOT 40 ms
            self.rec(0.300, 0.700, 11, [0.04] * 10),  # TTFT 300 ms, TPOT 40 ms
        ]
        kw: dict[str, Any] = {"urls": ["u"], "stream": True, "time_scale": 1, "duration_s": 2.0, "issued": 3}
        ttft = summarize(recs, slo_ttft_ms=200, slo_itl_ms=None, **kw)
        tpot = summarize(recs, slo_ttft_ms=None, slo_itl_ms=50, **kw)
        assert (ttft.slo_met, ttft.goodput_rps) == (2, pytest.approx(1.0))
        assert (tpot.slo_met, tpot.goodput_rps) == (2, pytest.approx(1.0))
        assert "SLO (TTFT ≤ 200 ms): 2/3 met" in format_table(ttft)
        assert "SLO (TPOT ≤ 50 ms): 2/3 met" in format_table(tpot)
        neither = summarize(recs, slo_ttft_ms=None, slo_itl_ms=None, **kw)
        assert neither.slo_met is None and neither.goodput_rps is None


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


async def _sims(n: int, **extra_env: str) -> tuple[list[web.AppRunner], list[str]]:
    env = {
        "GEARSHIFT_MODEL": str(LLAMA),
        "GEARSHIFT_SERVED_MODEL_NAME": "llama",
        "GEARSHIFT_PIPELINE": json.dumps({"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}),
        **extra_env,
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


async def test_rows_are_clipped_to_the_smallest_max_model_len_of_the_urls() -> None:
    """Two engines of different ``max_model_len``: only the first URL's (8192) was asked, so a 6,000-token
    row sent round-robin to the 4096 one was refused with a 400."""
    runners, urls = await _sims(1)
    small, small_urls = await _sims(1, GEARSHIFT_MAX_MODEL_LEN="4096")
    runners += small
    urls += small_urls
    trace = [TraceRequest(0.0, 6000, 3), TraceRequest(0.01, 6000, 3)]
    try:
        res = await run_load(urls, trace, max_requests=2, max_duration_s=5, drain_s=20, stream=True)
    finally:
        for r in runners:
            await r.cleanup()
    assert (res.completed, res.failed, res.clipped, res.max_model_len) == (2, 0, 2, 4096)
    assert {r.url for r in res.records} == set(urls)
    assert [r.prompt_tokens for r in res.records] == [4096 - 3] * 2


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


@pytest.fixture
def interrupted_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``gearshift loadgen`` arguments for a one-row trace, with ``run_load`` raising KeyboardInterrupt:
    the command reads its flags, then stops as at a Ctrl-C."""
    import gearshift.dev.loadgen as lg

    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,10,5\n")

    async def interrupted(*_a: object, **_k: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(lg, "run_load", interrupted)
    return ["loadgen", "--url", "http://127.0.0.1:1", "--trace", str(trace)]


def test_ctrl_c_is_one_line_and_exit_130(
    interrupted_cli: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An interrupted run (Ctrl-C) says so in one line, exit 130 (128 + SIGINT), no traceback."""
    from gearshift.cli import main

    assert main(interrupted_cli) == 130
    err = capsys.readouterr().err
    assert err == "gearshift loadgen: interrupted; the run was cut short, no report\n"


def test_an_slo_without_stream_is_warned_about(
    interrupted_cli: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--slo-ttft-ms`` without ``--stream`` counts nothing (no TTFT on a whole answer): one warning line."""
    from gearshift.cli import main

    args = [*interrupted_cli, "--slo-ttft-ms", "200"]
    main(args)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("gearshift loadgen: warning: --slo-ttft-ms/--slo-itl-ms count only with")
    main([*args, "--stream"])
    assert "warning" not in capsys.readouterr().err
