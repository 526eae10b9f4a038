"""A null OpenAI engine for the router overhead benchmark: answers every request at once (loopback only).

``python bench/router_null.py --port 9100`` serves ``/v1/completions`` (non-streamed, or a two-event
stream), ``/v1/models``, ``/health`` and an empty ``/metrics``; a ``kv_transfer_params.do_remote_decode``
request gets PD ``kv_transfer_params`` back, so it also stands in for prefill and decode pods.
"""

from __future__ import annotations

import argparse
import json

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


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        return web.json_response(PREFILL_ANSWER)
    if body.get("stream"):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: " + json.dumps(ANSWER).encode() + b"\n\ndata: [DONE]\n\n")
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
    a = p.parse_args()
    if not a.host.startswith("127.") and a.host != "::1":
        raise SystemExit("--host must be a loopback address")
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
