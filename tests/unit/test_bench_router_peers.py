"""bench/router_peers.py's pure parts: the FastChat worker adapter's chunks (read back the way FastChat's own
API server reads them, into FastChat's own protocol types), the pydantic-2 shim of FastChat's API server,
and the goal and GPU-hour maths."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def fw(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("fastchat_worker")


@pytest.fixture(scope="module")
def rp(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("router_peers")


def _sse(tokens: list[str], finish: str = "length", usage: int | None = None) -> bytes:
    """A /v1/completions stream as vLLM (and gearshift-sim) send it: one token per event, the last with a
    finish_reason, then an optional usage-only event and [DONE]."""
    out = b""
    for i, t in enumerate(tokens):
        fr = finish if i == len(tokens) - 1 else None
        choice = {"index": 0, "text": t, "finish_reason": fr}
        doc = {"id": "c", "object": "text_completion", "choices": [choice]}
        out += b"data: " + json.dumps(doc).encode() + b"\n\n"
    if usage is not None:
        doc2: dict[str, Any] = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": usage}}
        out += b"data: " + json.dumps(doc2).encode() + b"\n\n"
    return out + b"data: [DONE]\n\n"


def _fastchat_read(stream: bytes) -> list[dict[str, Any]]:
    """FastChat's openai_api_server.generate_completion_stream: NUL-delimited JSON, empty pieces skipped."""
    return [json.loads(c) for c in stream.split(b"\0") if c]


@pytest.mark.parametrize("split", [1, 7, 10_000])
def test_chunks_are_fastchats_cumulative_format(fw: ModuleType, split: int) -> None:
    from fastchat.protocol.openai_api_protocol import CompletionResponseStreamChoice

    tokens = [" tok", " tok", " a", " b"]
    raw = _sse(tokens)
    conv = fw.SSEToFastChat(prompt_tokens=4)
    out = b"".join(b"".join(conv.feed(raw[i : i + split])) for i in range(0, len(raw), split))
    chunks = _fastchat_read(out)
    # one chunk per token, and the finished output twice (finish_reason null first), as vllm_worker.py does
    assert len(chunks) == len(tokens) + 1
    assert [c["finish_reason"] for c in chunks] == [None] * len(tokens) + ["length"]
    assert all(c["error_code"] == 0 for c in chunks)
    # FastChat's delta logic (chat/completion stream generators) recovers every token, in order
    prev, deltas = "", []
    for c in chunks:
        delta = c["text"][len(prev) :]
        prev = c["text"] if len(c["text"]) > len(prev) else prev
        if delta:
            deltas.append(delta)
        CompletionResponseStreamChoice(index=0, text=delta, finish_reason=c["finish_reason"])
    assert deltas == tokens
    assert chunks[-1]["text"] == " tok tok a b"
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert conv.finished


def test_usage_event_sets_completion_tokens(fw: ModuleType) -> None:
    conv = fw.SSEToFastChat(prompt_tokens=4)
    conv.feed(_sse([" x", " y"], usage=2))
    assert conv.completion_tokens == 2
    assert conv.text == " x y"


def test_error_chunk_uses_fastchats_error_code(fw: ModuleType) -> None:
    from fastchat.constants import ErrorCode

    (c,) = _fastchat_read(fw.error_chunk("HTTP 503: busy"))
    assert c == {"text": "HTTP 503: busy", "error_code": int(ErrorCode.INTERNAL_ERROR)}
    assert c["error_code"] != 0  # what openai_api_server checks before it answers an error


def test_tokenizer_counts_as_the_simulator_does(fw: ModuleType) -> None:
    from gearshift.sim.request import count_prompt_tokens

    prompt = " ".join(["hi"] * 37)  # loadgen --chat's prompt; FastChat's raw template passes it through
    assert len(fw.WordTokenizer()(prompt).input_ids) == count_prompt_tokens(prompt) == 37


def test_raw_template_passes_the_chat_prompt_through() -> None:
    from fastchat.conversation import get_conv_template

    conv = get_conv_template("raw")
    conv.append_message(conv.roles[0], "hi hi hi")
    conv.append_message(conv.roles[1], None)
    assert conv.get_prompt() == "hi hi hi"


def test_sim_body(fw: ModuleType) -> None:
    body = fw.sim_body(
        {"model": "m", "prompt": "hi hi", "max_new_tokens": 9, "temperature": 0.7, "top_p": 1.0, "stop": []}
    )
    assert body == {
        "model": "m",
        "prompt": "hi hi",
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 1.0,
        "stream": True,
    }


def test_worker_is_a_fastchat_base_model_worker(fw: ModuleType) -> None:
    from fastchat.serve.base_model_worker import BaseModelWorker

    cls = fw.make_worker_class()
    assert issubclass(cls, BaseModelWorker)
    # FastChat's registration, heartbeat, queue length and status are inherited, not ours
    for name in ("init_heart_beat", "send_heart_beat", "get_queue_length", "get_status", "count_token"):
        assert getattr(cls, name) is getattr(BaseModelWorker, name)


def test_api_shim_matches_model_dump_json(bench_module: Callable[[str], ModuleType]) -> None:
    from fastchat.protocol.openai_api_protocol import ChatCompletionStreamResponse

    shim = bench_module("fastchat_api")
    chunk = ChatCompletionStreamResponse.model_validate(
        {"id": "x", "model": "m", "choices": [{"index": 0, "delta": {"content": "é"}}]}
    )
    got = shim._json(chunk, exclude_unset=True, ensure_ascii=False)
    assert got == chunk.model_dump_json(exclude_unset=True)
    assert json.loads(got)["choices"][0]["delta"] == {"content": "é"}


def _pt(p99: float | None, failed: int = 0, incomplete: int = 0) -> dict[str, Any]:
    ttft = None if p99 is None else {"p50": 1.0, "p99": p99}
    return {"ttft_ms": ttft, "failed": failed, "incomplete": incomplete, "issued": 100}


def test_goals_met(rp: ModuleType) -> None:
    points = {
        "50%": {
            "gearshift-plain": _pt(100),
            "fastchat-shortest_queue": _pt(300),
            "fastchat-lottery": _pt(400),
            "gearshift-pd": _pt(100),
            "vllm-toy-proxy": _pt(150),
        },
        "80%": {
            "gearshift-plain": _pt(600),
            "fastchat-shortest_queue": _pt(1000),
            "fastchat-lottery": _pt(900),
            "gearshift-pd": _pt(400),
            "vllm-toy-proxy": _pt(1000),
        },
    }
    g = rp.goals(points)
    assert g["vs_fastchat_sq_80"]["reduction"] == pytest.approx(0.4)  # 1 − 600 / 1000
    assert g["vs_fastchat_sq_80"]["met"] is True
    assert g["vs_vllm_proxy_80"]["ratio"] == pytest.approx(2.5)  # 1000 / 400
    assert g["vs_vllm_proxy_80"]["met"] is True
    assert len(g["no_worse"]["comparisons"]) == 6  # 2 loads × (2 FastChat + 1 vLLM)
    assert g["no_worse"]["met"] is True


def test_goals_not_met(rp: ModuleType) -> None:
    points = {
        "50%": {
            "gearshift-plain": _pt(500),
            "fastchat-shortest_queue": _pt(300),
            "fastchat-lottery": _pt(600, incomplete=2),
            "gearshift-pd": _pt(100),
            "vllm-toy-proxy": _pt(150),
        },
        "80%": {
            "gearshift-plain": _pt(800),
            "fastchat-shortest_queue": _pt(1000),
            "fastchat-lottery": _pt(900),
            "gearshift-pd": _pt(600, failed=1),
            "vllm-toy-proxy": _pt(1000),
        },
    }
    g = rp.goals(points)
    assert g["vs_fastchat_sq_80"]["reduction"] == pytest.approx(0.2)  # 1 − 800 / 1000 < 0.30
    assert g["vs_fastchat_sq_80"]["met"] is False
    assert g["vs_vllm_proxy_80"]["ratio"] == pytest.approx(1000 / 600)  # < 2
    assert g["vs_vllm_proxy_80"]["met"] is False
    rows = g["no_worse"]["comparisons"]
    assert rows["50% gearshift-plain vs fastchat-shortest_queue"]["met"] is False  # 500 > 300
    assert rows["50% gearshift-plain vs fastchat-lottery"]["met"] is True  # 500 <= 600, 0 <= 2 unfinished
    assert rows["50% gearshift-plain vs fastchat-lottery"]["peer_failed_or_incomplete"] == 2
    assert rows["80% gearshift-pd vs vllm-toy-proxy"]["met"] is False  # faster, but 1 failed vs 0
    assert g["no_worse"]["met"] is False


def test_goals_missing_numbers_are_not_met(rp: ModuleType) -> None:
    g = rp.goals({"80%": {"gearshift-plain": _pt(None), "fastchat-shortest_queue": _pt(1000)}})
    assert g["vs_fastchat_sq_80"]["met"] is False
    assert g["vs_vllm_proxy_80"]["met"] is False
    assert g["no_worse"]["met"] is False
    assert rp.goals({})["no_worse"]["met"] is False


def test_incomplete_counts_against_gearshift_too(rp: ModuleType) -> None:
    pts = {"80%": {"gearshift-pd": _pt(100, incomplete=1), "vllm-toy-proxy": _pt(900)}}
    row = rp.goals(pts)["no_worse"]["comparisons"]["80% gearshift-pd vs vllm-toy-proxy"]
    assert row["gearshift_failed_or_incomplete"] == 1
    assert row["met"] is False


def test_notes_name_unfinished_and_failed(rp: ModuleType) -> None:
    out = {
        "drain_s": 20.0,
        "points": {
            "80%": {
                "fastchat-lottery": _pt(900, incomplete=7) | {"frontend_cpu_ms_per_request": 90.0},
                "gearshift-plain": _pt(100, failed=1)
                | {"errors": {"HTTP 504": 1}, "frontend_cpu_ms_per_request": 10.0},
            }
        },
    }
    text = " | ".join(rp.notes(out))
    assert "80% fastchat-lottery: 7 of 100 requests still unfinished 20.0 s" in text
    assert "80% gearshift-plain: 1 failed: {'HTTP 504': 1}" in text
    assert "fastchat-lottery 90, gearshift-plain 10" in text


def test_gpu_hours(rp: ModuleType) -> None:
    h = rp.gpu_hours(["H100-80GB", "A10-24GB", "A10-24GB"], 1800.0)
    assert h == {"H100-80GB": 0.5, "A10-24GB": 1.0, "total": 1.5}
