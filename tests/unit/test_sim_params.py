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

from gearshift.sim.config import config_from_env
from gearshift.sim.server import TOKEN_TEXT, build_app, stop_point


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
