"""A null OpenAI engine for the router overhead benchmark: answers every request at once (loopback only).

``python bench/router_null.py --port 9100`` serves ``/v1/completions`` (non-streamed, or a stream of
``max_tokens`` token events), ``/v1/models``, ``/health`` and an empty ``/metrics``; a
``kv_transfer_params.do_remote_decode`` request gets PD ``kv_transfer_params`` back, so it also stands in
for prefill and decode pods.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvloop
from aiohttp import web

ANSWER = {
    "id": "cmpl-null",
    "object": "text_completion",
    "choices": [{"index": 0, "text": " tok", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
PREFILL_ANSWER = ANSWER | {
    "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "num_prompt_tokens": 1}
}
#: One token event of a stream, shaped as vLLM's completion chunks (a ~150-byte JSON document).
TOKEN_EVENT = (
    b'data: {"id":"cmpl-null","object":"text_completion","created":1733100000,"model":"null",'
    b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n'
)


async def completions(request: web.Request) -> web.StreamResponse:
    """A whole answer, or a stream of ``max_tokens`` token events (in one chunk, or with ``--event-gap-ms``
    one chunk per event that far apart) then a usage chunk when ``stream_options.include_usage`` asks for
    it, then ``[DONE]``."""
    body = await request.json()
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        return web.json_response(PREFILL_ANSWER)
    if body.get("stream"):
        n = max(1, int(body.get("max_tokens") or 1))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        tail = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            doc = {"id": "cmpl-null", "choices": [], "usage": usage}
            tail = b"data: " + json.dumps(doc).encode() + b"\n\n"
        if gap_s := request.app["event_gap_s"]:
            for _ in range(n):  # one chunk per token, as an engine streams them
                await out.write(TOKEN_EVENT)
                await asyncio.sleep(gap_s)
            await out.write(tail + b"data: [DONE]\n\n")
        else:
            await out.write(TOKEN_EVENT * n + tail + b"data: [DONE]\n\n")
        await out.write_eof()
        return out
    return web.json_response(ANSWER)


async def models(_r: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "null", "object": "model"}]})


async def health(_r: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(_r: web.Request) -> web.Response:
    return web.Response(text="", content_type="text/plain")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--event-gap-ms", type=float, default=0.0, help="one chunk per token, ms apart")
    a = p.parse_args()
    if not a.host.startswith("127.") and a.host != "::1":
        raise SystemExit("--host must be a loopback address")
    app = web.Application()
    app["event_gap_s"] = a.event_gap_ms / 1000
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    # uvloop, as the router runs: the null pods share a core with the load generator in
    # bench/router_cost.py's pinned layout, so their own cost is kept small.
    web.run_app(app, host=a.host, port=a.port, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
