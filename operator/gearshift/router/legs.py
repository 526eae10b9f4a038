"""The two legs of a PD request as vLLM's own proxy sends them: their bodies, their headers, and the one
request id they share (docs/ARCHITECTURE.md). Pure: no I/O; :mod:`gearshift.router.proxy` sends the legs and
:mod:`gearshift.router.mirror` sends copies of them to warming pods.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Mapping
from typing import Any

#: The header both legs of one PD request share. vLLM's serving layer takes the engine request id from it
#: (``_base_request_id``: vllm/entrypoints/openai/serving_engine.py, 0.11-0.12;
#: vllm/entrypoints/serve/engine/serving.py, 0.32). On vLLM 0.11-0.12 the decode side's NixlConnector
#: tells the prefill side to free the request's KV blocks under *its own* request id, so two different ids
#: leave the prefill pod holding them until ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` passes (120 s there;
#: vllm/envs.py). Later versions also send ``remote_request_id`` in ``kv_transfer_params``
#: (NIXL_CONNECTOR_VERSION 2, vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py); one id
#: for both legs is still what vLLM's toy proxy sends
#: (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py).
REQUEST_ID_HEADER = "X-Request-Id"


def prefill_kv_transfer_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill leg: vLLM's toy proxy's, key for key
    (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, ``send_request_to_service``).
    ``do_remote_decode: true`` makes the prefill pod's NixlConnector keep the prompt's KV blocks for a decode
    pod to pull and answer with the parameters that pod needs (``request_finished`` in
    vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py; nixl/pull_scheduler.py in 0.32)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def is_chat(path: str) -> bool:
    """Whether ``path`` is the chat completions endpoint."""
    return path.endswith("/chat/completions")


def prefill_leg_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg's body: the client's request with the changes vLLM's toy proxy makes
    (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, ``send_request_to_service``):

    - ``kv_transfer_params`` = :func:`prefill_kv_transfer_params` (replacing any the client sent);
    - ``stream: false`` (the router reads the prefill pod's ``kv_transfer_params`` from one JSON body;
      vLLM returns them in the non-streamed response, vllm/entrypoints/openai/protocol.py
      ``CompletionResponse.kv_transfer_params``);
    - ``max_tokens: 1``, and ``max_completion_tokens: 1`` where the client sent it — always for chat, where
      vLLM's ``ChatCompletionRequest`` reads ``max_completion_tokens`` before ``max_tokens``; completions
      has no such field, so it is only overwritten there, never added;
    - ``stream_options`` removed (vLLM refuses it when ``stream`` is false: ``validate_stream_options``
      in vllm/entrypoints/openai/protocol.py);
    - ``min_tokens`` and ``min_completion_tokens`` removed ("not supported for P": a minimum above the
      one token would fail vLLM's ``min_tokens <= max_tokens`` check in vllm/sampling_params.py).

    The client's ``body`` is not changed (the decode leg is built from it). (vllm/entrypoints/openai/
    protocol.py is split into openai/completion/protocol.py and openai/chat_completion/protocol.py by 0.32.)
    """
    leg = dict(body)
    leg["kv_transfer_params"] = prefill_kv_transfer_params()
    leg["stream"] = False
    leg["max_tokens"] = 1
    if chat or "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    leg.pop("min_completion_tokens", None)
    return leg


def decode_leg_body(body: Mapping[str, Any], prefill_response: Any) -> dict[str, Any]:
    """The decode leg's body: the client's request as it came, with ``kv_transfer_params`` set to what the
    prefill pod's response returned, when it returned any (vLLM's toy proxy,
    tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, ``_handle_completions``). Without them (a
    prefill pod with no KV connector answers ``kv_transfer_params: null``) the decode pod gets the plain
    request and prefills it itself, as there."""
    leg = dict(body)
    ktp = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
    if ktp:
        leg["kv_transfer_params"] = ktp
    return leg


class RequestIds:
    """Fresh request ids, 32 hex digits like vLLM's ``random_uuid`` (``uuid4().hex``, vllm/utils): a random
    20-digit prefix per router process and a 12-digit sequence number. Unique across routers and restarts
    by the prefix; cheaper than a ``uuid4`` per request (no ``getrandom`` call on the hot path)."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:20]
        self._seq = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._seq) % 16**12:012x}"


def request_id_for(
    headers: Mapping[str, str], body: Mapping[str, Any], fresh: Callable[[], str] = lambda: uuid.uuid4().hex
) -> str:
    """The request's id: the client's ``X-Request-Id`` header, else the ``request_id`` of its body (vLLM's
    own request field, vllm/entrypoints/openai/protocol.py, which vLLM uses when no header is given), else
    ``fresh()`` (by default ``uuid4().hex``, as vLLM's ``random_uuid``; the router's is
    :class:`RequestIds`)."""
    rid = headers.get(REQUEST_ID_HEADER)
    if rid and rid.strip():
        return rid
    rid = body.get("request_id")
    if isinstance(rid, str) and rid.strip():
        return rid
    return fresh()


def leg_headers(request_id: str, authorization: str | None = None) -> dict[str, str]:
    """Headers of a leg to an engine: JSON, the shared ``X-Request-Id`` and the client's
    ``Authorization`` (vLLM's toy proxy sends ``Authorization: Bearer $OPENAI_API_KEY``; passing the
    client's through serves engines started with ``--api-key`` the same way)."""
    h = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
    if authorization:
        h["Authorization"] = authorization
    return h
