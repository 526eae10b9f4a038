"""The simulated engine's request parameters as vLLM reads them: lax types (vLLM's pydantic models, asked
through the vLLM venv), ``stop`` applied, and fields it cannot honour refused naming the field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_sim_engine import a10_env
from vllm_ref import vllm_protocol

from gearshift.sim.app import build_app
from gearshift.sim.config import config_from_env
from gearshift.sim.request import TOKEN_TEXT, stop_point


@pytest.fixture
async def sim() -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(build_app(config_from_env(a10_env())), host="127.0.0.1"))
    await client.start_server()
    yield client
    await client.close()


def test_stop_point_on_the_periodic_output() -> None:
    assert TOKEN_TEXT == " tok"  # the cases below are worked out on " tok tok tok ..."
    assert stop_point([" tok"], 9) == (1, 0)  # the first token completes it: nothing returned
    assert stop_point(["ok t"], 9) == (2, 2)  # " tok tok": found at 2, completed by token 2
    assert stop_point(["ok t"], 9, include_stop=True) == (2, 6)
    assert stop_point(["ok t"], 1) is None  # needs two tokens
    assert stop_point(["zz", "k"], 9) == (1, 3)  # the earliest of several
    assert stop_point(["tok tok tok"], 9) == (3, 1)
    assert stop_point([], 9) is None


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_ends_the_output_as_vllm_does(sim: TestClient, stream: bool) -> None:
    body = {"prompt": "a b", "max_tokens": 8, "stop": ["ok t"], "stream": stream}
    resp = await sim.post("/v1/completions", json=body)
    assert resp.status == 200
    if stream:
        events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        doc = await resp.json()
        text, finish = doc["choices"][0]["text"], doc["choices"][0]["finish_reason"]
        assert doc["usage"]["completion_tokens"] == 2
    assert (text, finish) == (" t", "stop")


@pytest.mark.parametrize(
    ("field", "value", "chat"),
    [
        ("logprobs", 1, False),
        ("logprobs", 0, False),  # still asks for the sampled token's logprob
        ("logprobs", True, True),
        ("echo", True, False),
        ("n", 2, False),
        ("best_of", 3, False),
        ("response_format", {"type": "json_object"}, True),
        ("tools", [{"type": "function", "function": {"name": "f"}}], True),
    ],
)
async def test_fields_it_cannot_honour_are_refused_by_name(
    sim: TestClient, field: str, value: Any, chat: bool
) -> None:
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/v1/completions", {"prompt": "hi"}
    # vLLM itself reads the field as a request for something (its own model accepts it)
    vllm_protocol().request("chat" if chat else "completion", {**body, field: value})
    resp = await sim.post(path, json={**body, field: value})
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["param"] == field, err
    # the neutral value is served
    neutral = {"logprobs": None, "echo": False, "n": 1, "best_of": 1, "response_format": None, "tools": []}
    assert (await sim.post(path, json={**body, field: neutral[field]})).status == 200


@pytest.mark.parametrize(
    "extra",
    [{"stream": "yes"}, {"stream": "false"}, {"stream": "0"}, {"max_tokens": "3"}, {"stream": 1}],
)
async def test_types_are_read_as_vllm_reads_them(sim: TestClient, extra: dict[str, Any]) -> None:
    body = {"prompt": "a b", "max_tokens": 2, **extra}
    want = vllm_protocol().request("completion", body)
    resp = await sim.post("/v1/completions", json=body)
    assert resp.status == 200
    streamed = resp.headers["Content-Type"].startswith("text/event-stream")
    assert streamed == want["stream"]
    if not streamed:
        assert (await resp.json())["usage"]["completion_tokens"] == want["max_tokens"]


async def test_a_type_vllm_refuses_is_refused(sim: TestClient) -> None:
    out = vllm_protocol().call("request", kind="completion", body={"prompt": "x", "stream": "maybe"})
    assert not out["ok"]
    resp = await sim.post("/v1/completions", json={"prompt": "x", "stream": "maybe"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "stream"


def _llama8b_config() -> dict[str, Any]:
    from test_sim_engine import LLAMA8B_PATH

    return dict(json.loads(Path(LLAMA8B_PATH).read_text()))


def test_the_model_arch_carries_the_models_context_limit() -> None:
    from gearshift.facts.model import ModelArch, arch_from_hf_config

    cfg = _llama8b_config()
    arch = arch_from_hf_config(cfg)
    assert arch.max_position_embeddings == cfg["max_position_embeddings"] == 8192
    assert ModelArch(**arch.to_dict()) == arch
    # a model without a limit keeps the JSON it had before the field existed (no pod template changes)
    unset = ModelArch(**{**arch.to_dict(), "max_position_embeddings": None})
    assert "max_position_embeddings" not in unset.to_dict()


async def test_the_context_limit_is_the_models_own_as_in_vllm(sim: TestClient) -> None:
    card = (await (await sim.get("/v1/models")).json())["data"][0]
    assert card["max_model_len"] == 8192  # Llama-3-8B's own, not the A10's KV pool (54,400 tokens)
    resp = await sim.post("/v1/completions", json={"prompt": [1] * (8192 - 10), "max_tokens": 20})
    assert resp.status == 400 and "maximum context length is 8192" in (await resp.json())["error"]["message"]


#: Sampling fields by the values vLLM's own request model and SamplingParams take or refuse.
SAMPLING_CASES = [
    {"temperature": "hot"}, {"temperature": "0.5"}, {"temperature": -1}, {"temperature": 3.0},
    {"temperature": None},
    {"top_p": 0}, {"top_p": 1.5}, {"top_p": "x"}, {"top_p": 1},
    {"top_k": "many"}, {"top_k": 0}, {"top_k": -1}, {"top_k": -2}, {"top_k": 2.5}, {"top_k": "3"},
    {"min_p": 2}, {"min_p": -0.1}, {"min_p": 0.2},
    {"presence_penalty": 3}, {"frequency_penalty": -3}, {"frequency_penalty": 1.5},
    {"repetition_penalty": 0}, {"repetition_penalty": "x"}, {"repetition_penalty": 1.1},
    {"seed": 1.5}, {"seed": "7"}, {"seed": -1},
    {"ignore_eos": "perhaps"}, {"ignore_eos": "yes"}, {"skip_special_tokens": "nah"},
    {"min_tokens": -1}, {"min_tokens": "2"}, {"min_tokens": 5},
]  # fmt: skip


@pytest.mark.parametrize("extra", SAMPLING_CASES, ids=lambda e: json.dumps(e))
async def test_sampling_fields_are_refused_where_vllm_refuses_them(
    sim: TestClient, extra: dict[str, Any]
) -> None:
    """``"temperature": "hot"`` was served (the simulator samples nothing); vLLM answers 400."""
    body = {"prompt": "a b", "max_tokens": 3, **extra}
    want = vllm_protocol().call("request", kind="completion", body=body)
    resp = await sim.post("/v1/completions", json=body)
    assert (resp.status == 200) == bool(want["ok"]), (await resp.text(), want)
    if resp.status != 200:
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["param"] == next(iter(extra)), err


#: ``stream_options`` by what vLLM's request models make of them (the worker asks them): the string
#: ``"false"`` is False (the sim read it as True and sent usage), a non-object is refused, options with a
#: raw falsy ``stream`` are refused, ``continuous_usage_stats`` puts usage on every chunk.
STREAM_OPTIONS_CASES = [
    {"stream": True, "stream_options": {"include_usage": "false"}},
    {"stream": True, "stream_options": {"include_usage": "true"}},
    {"stream": True, "stream_options": {"include_usage": 1}},
    {"stream": True, "stream_options": {"include_usage": "maybe"}},
    {"stream": True, "stream_options": {"include_usage": 2}},
    {"stream": True, "stream_options": {"include_usage": None}},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}},
    {"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "often"}},
    {"stream": True, "stream_options": {"other": 1}},
    {"stream": True, "stream_options": "x"},
    {"stream": True, "stream_options": []},
    {"stream": True, "stream_options": True},
    {"stream": True, "stream_options": None},
    {"stream": False, "stream_options": {"include_usage": True}},
    {"stream_options": {"include_usage": False}},
    {"stream": False, "stream_options": {}},
    {"stream": False, "stream_options": "x"},
    {"stream": False, "stream_options": 0},
    {"stream": "false", "stream_options": {"include_usage": True}},
]


def _events(text: str) -> list[dict[str, Any]]:
    payloads = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [json.loads(e) for e in payloads if e != "[DONE]"]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("extra", STREAM_OPTIONS_CASES, ids=lambda e: json.dumps(e))
async def test_stream_options_are_read_as_vllm_reads_them(
    sim: TestClient, extra: dict[str, Any], chat: bool
) -> None:
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}]}
    else:
        path, body = "/v1/completions", {"prompt": "a b"}
    body = {**body, "max_tokens": 3, **extra}
    want = vllm_protocol().call("request", kind="chat" if chat else "completion", body=body)
    resp = await sim.post(path, json=body)
    assert (resp.status == 200) == bool(want["ok"]), (await resp.text(), want)
    if resp.status != 200:
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["param"] == "stream_options", err
        if "Stream options can only be defined" in want["error"]:
            assert err["message"] == "Stream options can only be defined when `stream=True`."
        return
    if not want["stream"]:
        assert not resp.headers["Content-Type"].startswith("text/event-stream")
        return
    opts = want["stream_options"] or {}
    include = bool(opts.get("include_usage"))
    continuous = include and bool(opts.get("continuous_usage_stats"))
    chunks = _events(await resp.text())
    tail = [c for c in chunks if not c["choices"]]
    assert len(tail) == int(include), chunks
    if include:
        assert tail[0]["usage"]["completion_tokens"] == 3
    with_choices = [c for c in chunks if c["choices"]]
    assert all(("usage" in c) == continuous for c in with_choices), with_choices


async def test_continuous_usage_stats_count_the_tokens_so_far(sim: TestClient) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (
        ("/v1/completions", {"prompt": "a b"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}]}),
    ):
        resp = await sim.post(path, json={**body, "max_tokens": 4, "stream": True, "stream_options": opts})
        chunks = _events(await resp.text())
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 4, chunks
        assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)
        assert all(c["usage"]["total_tokens"] == 2 + c["usage"]["completion_tokens"] for c in chunks)
        if "messages" in body:  # the role chunk comes before any token
            assert counts[0] == 0
        texts = [
            c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
            for c in chunks[:-1]
        ]
        assert sum(t.count("tok") for t in texts if t) == 4


class TestMaxModelLenAboveTheModels:
    """``--max-model-len`` above the model's ``max_position_embeddings`` was served silently; vLLM refuses
    it at start-up unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set."""

    def test_refused_naming_the_flag_and_the_limit(self) -> None:
        from gearshift.sim.config import SimConfigError

        with pytest.raises(SimConfigError, match=r"--max-model-len\) 9000 .*max_position_embeddings=8192"):
            config_from_env(a10_env(GEARSHIFT_MAX_MODEL_LEN="9000"))
        assert config_from_env(a10_env(GEARSHIFT_MAX_MODEL_LEN="8192")).max_model_len == 8192
        allowed = config_from_env(a10_env(GEARSHIFT_MAX_MODEL_LEN="9000", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1"))
        assert allowed.max_model_len == 9000

    def test_the_command_exits_2_with_one_line(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import gearshift.sim.server as server
        from gearshift.sim.server import main

        async def served(_configs: Any) -> None:  # without the check the pod would start and serve
            return None

        monkeypatch.setattr(server, "serve", served)
        monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
        env = a10_env()
        argv = ["--model", env["GEARSHIFT_MODEL"], "--pipeline", env["GEARSHIFT_PIPELINE"]]
        assert main([*argv, "--max-model-len", "100000", "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("gearshift-sim: GEARSHIFT_MAX_MODEL_LEN (--max-model-len) 100000")
            and err.count("\n") == 1
        ), err
