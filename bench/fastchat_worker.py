"""A thin FastChat model worker in front of one gearshift-sim pod (for bench/router_peers.py).

It subclasses FastChat's own ``fastchat.serve.base_model_worker.BaseModelWorker`` and serves FastChat's own
worker app (``base_model_worker.app``: ``/worker_generate_stream``, ``/worker_get_status``, ``/count_token``,
``/worker_get_conv_template``, ``/model_details``), so registration, heartbeats, the queue length
(FastChat's semaphore) and the speed it reports (1, BaseModelWorker's) are FastChat's code. Only
``generate_stream_gate`` is ours: it forwards the prompt FastChat built to the pod's ``/v1/completions``
(streamed) and yields FastChat's worker chunks, as ``fastchat/serve/vllm_worker.py`` does: NUL-terminated
JSON ``{"text": <all text so far>, "error_code": 0, "usage": {...}, "finish_reason": ...}``, the last one
twice (first with ``finish_reason`` null). The tokenizer FastChat asks for ``/count_token`` counts words,
as the simulator counts a text prompt.

Usage: python bench/fastchat_worker.py --port P --controller-address http://127.0.0.1:C --sim-url URL
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from gearshift.dev.loadgen import sse_json_events

#: FastChat's vllm_worker default (``--limit-worker-concurrency 1024``): the engine batches, FastChat only
#: counts. (model_worker's default of 5 is for its one-request-at-a-time HF generate loop.)
LIMIT_WORKER_CONCURRENCY = 1024


def fastchat_chunk(text: str, prompt_tokens: int, completion_tokens: int, finish_reason: str | None) -> bytes:
    """One FastChat worker stream chunk (vllm_worker.py's ``ret``, NUL-terminated)."""
    ret = {
        "text": text,
        "error_code": 0,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "finish_reason": finish_reason,
    }
    return (json.dumps(ret) + "\0").encode()


def error_chunk(message: str) -> bytes:
    from fastchat.constants import ErrorCode

    return (json.dumps({"text": message, "error_code": int(ErrorCode.INTERNAL_ERROR)}) + "\0").encode()


class SSEToFastChat:
    """OpenAI completions SSE bytes (any split) → FastChat worker chunks with cumulative text."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.text = ""
        self.tokens = 0
        self.usage_tokens: int | None = None
        self.finished = False
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        docs, self._buf = sse_json_events(self._buf + data)
        for doc in docs:
            if doc.get("usage"):
                self.usage_tokens = int(doc["usage"].get("completion_tokens", 0))
            for c in doc.get("choices") or []:
                piece = c.get("text") or ""
                finish = c.get("finish_reason")
                if piece:
                    self.text += piece
                    self.tokens += 1
                if finish is not None:
                    # vllm_worker.py emits the finished output twice: finish_reason null, then set.
                    out.append(fastchat_chunk(self.text, self.prompt_tokens, self.completion_tokens, None))
                    out.append(fastchat_chunk(self.text, self.prompt_tokens, self.completion_tokens, finish))
                    self.finished = True
                elif piece:
                    out.append(fastchat_chunk(self.text, self.prompt_tokens, self.completion_tokens, None))
        return out

    @property
    def completion_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.tokens


class WordTokenizer:
    """What BaseModelWorker.count_token calls: ``tokenizer(prompt).input_ids`` (the simulator's count)."""

    def __call__(self, prompt: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=prompt.split())


def sim_body(params: dict[str, Any]) -> dict[str, Any]:
    """The pod's /v1/completions body for FastChat's gen_params (what vllm_worker.py hands its engine)."""
    body: dict[str, Any] = {
        "model": params["model"],
        "prompt": params["prompt"],
        "max_tokens": int(params.get("max_new_tokens") or 256),
        "temperature": float(params.get("temperature") or 1.0),
        "top_p": max(float(params.get("top_p") or 1.0), 1e-5),
        "stream": True,
    }
    if params.get("stop"):
        body["stop"] = list(params["stop"])
    return body


def make_worker_class() -> type:
    from fastchat.serve.base_model_worker import BaseModelWorker

    class SimModelWorker(BaseModelWorker):  # type: ignore[misc]
        def __init__(
            self,
            *,
            controller_addr: str,
            worker_addr: str,
            worker_id: str,
            sim_url: str,
            model_names: list[str],
            limit_worker_concurrency: int,
            context_len: int,
        ) -> None:
            super().__init__(
                controller_addr,
                worker_addr,
                worker_id,
                sim_url,
                model_names,
                limit_worker_concurrency,
                conv_template="raw",
            )
            self.sim_url = sim_url.rstrip("/")
            self.tokenizer = WordTokenizer()
            self.context_len = context_len
            self._session: Any = None

        def make_conv_template(self, conv_template: str | None = None, model_path: str | None = None) -> Any:
            # BaseModelWorker's hook ("can be overrided"): its default imports fastchat.model.model_adapter
            # (torch, transformers, psutil) even for a named template; FastChat's own registry is enough.
            from fastchat.conversation import get_conv_template

            return get_conv_template(conv_template or "raw")

        async def generate_stream_gate(self, params: dict[str, Any]) -> AsyncIterator[bytes]:
            import aiohttp

            self.call_ct += 1
            if self._session is None:
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
                )
            conv = SSEToFastChat(len(self.tokenizer(params["prompt"]).input_ids))
            try:
                async with self._session.post(self.sim_url + "/v1/completions", json=sim_body(params)) as r:
                    if r.status != 200:
                        yield error_chunk(f"HTTP {r.status}: {(await r.text())[:200]}")
                        return
                    async for data in r.content.iter_any():
                        for chunk in conv.feed(data):
                            yield chunk
            except (aiohttp.ClientError, TimeoutError) as exc:
                yield error_chunk(f"{type(exc).__name__}: {exc}")

    return SimModelWorker


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--controller-address", required=True)
    p.add_argument("--sim-url", required=True)
    p.add_argument("--model-name", default="m")
    p.add_argument("--worker-id", default="sim")
    p.add_argument("--limit-worker-concurrency", type=int, default=LIMIT_WORKER_CONCURRENCY)
    a = p.parse_args()
    import uvicorn
    from fastchat.serve import base_model_worker

    with urllib.request.urlopen(a.sim_url.rstrip("/") + "/v1/models", timeout=10) as r:
        context_len = int(json.load(r)["data"][0].get("max_model_len") or 8192)
    worker = make_worker_class()(
        controller_addr=a.controller_address,
        worker_addr=f"http://{a.host}:{a.port}",
        worker_id=a.worker_id,
        sim_url=a.sim_url,
        model_names=[a.model_name],
        limit_worker_concurrency=a.limit_worker_concurrency,
        context_len=context_len,
    )
    # FastChat's own registration and heartbeat thread; the controller must already be up.
    worker.init_heart_beat()
    uvicorn.run(base_model_worker.app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
