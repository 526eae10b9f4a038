"""What the router answers itself: OpenAI-shaped errors as vLLM writes them
(``{"error": {"message", "type", "param", "code"}}``), the checks of a client's body that raise them, and the
error a failed prefill leg becomes. Every error response carries the request's ``X-Request-Id``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from gearshift.facts.lax import LAX_INT, read_lax
from gearshift.router.legs import REQUEST_ID_HEADER

log = logging.getLogger(__name__)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """An error as vLLM answers one: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
    status as ``code`` (``ErrorResponse``/``ErrorInfo``, vllm/entrypoints/serve/engine/protocol.py, 0.32)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    """:func:`error_body` as a JSON response of that status."""
    return web.json_response(error_body(status, message, err_type, param), status=status)


class StreamEnded(Exception):
    """A stream the router had started ended early: the client went away (``client_disconnected``) or the
    engine broke off (``upstream_error``, told to the client as a last SSE ``error`` event, as vLLM does).
    Nothing more can be sent: the status line went out with the first byte."""

    def __init__(self, outcome: str, response: web.StreamResponse) -> None:
        super().__init__(outcome)
        self.outcome, self.response = outcome, response


class RequestError(Exception):
    """A request the router answers itself with an error (status, message, type)."""

    def __init__(
        self, status: int, message: str, err_type: str, outcome: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.outcome = status, message, err_type, outcome
        self.param = param


def _upstream_error_text(text: str) -> tuple[str, str | None, str | None]:
    """The message, type and param of an engine's error body: vLLM's ``{"error": {"message", "type",
    "param", ..}}`` (``ErrorResponse``, vllm/entrypoints/serve/engine/protocol.py), its older flat
    ``{"object": "error", "message", "type"}``, or the raw text."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(empty body)", None, None
    if isinstance(doc, dict):
        error = doc.get("error")
        inner = error if isinstance(error, dict) else doc
        msg = inner.get("message")
        if isinstance(msg, str):
            typ, param = inner.get("type"), inner.get("param")
            return msg, typ if isinstance(typ, str) else None, param if isinstance(param, str) else None
    return text.strip()[:500], None, None


def prefill_failed(pod: str, status: int, text: str, max_tokens: int | None = None) -> RequestError:
    """The error the client gets when the prefill leg fails: the engine's 4xx (the request itself is
    wrong for the model, e.g. too long) keeps its status, type and message, with a note that the prefill leg
    asked for one output token (an engine's context-length message counts that one, not the client's
    ``max_tokens``); the pod is named in the router's log, not to the client. Anything else is a 502."""
    msg, typ, param = _upstream_error_text(text)
    if 400 <= status < 500:
        log.info("prefill pod %s refused a request (HTTP %d): %s", pod, status, msg[:200])
        asked = f"; this request's max_tokens is {max_tokens}" if max_tokens is not None else ""
        return RequestError(
            status,
            f"{msg} (from the prefill leg of this PD request, which asks for 1 output token{asked})",
            typ or "BadRequestError",
            "client_error",
            param,
        )
    return RequestError(
        502,
        f"prefill pod {pod} failed (HTTP {status}): {msg}; the decode pod was not called",
        "upstream_error",
        "upstream_error",
    )


def with_request_id(resp: web.Response, rid: str | None) -> web.Response:
    """``resp`` with the request's ``X-Request-Id`` header, when the request has one yet."""
    if rid:
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def validate_body(body: Any, path: str) -> dict[str, Any]:
    """Check the fields the router relies on.

    Raises:
        RequestError: 400 naming the field and the fix.
    """
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object", "BadRequestError", "client_error")
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError(
                400,
                "'messages' must be a non-empty list of {role, content}",
                "BadRequestError",
                "client_error",
                "messages",
            )
    elif "prompt" not in body:
        raise RequestError(
            400,
            "'prompt' is required (a string or a list of token ids)",
            "BadRequestError",
            "client_error",
            "prompt",
        )
    mt = body.get("max_tokens", body.get("max_completion_tokens"))
    # Lax as vLLM's models read it: "3" is 3 and true is 1 (measured on vLLM 0.32's CompletionRequest).
    n = None if mt is None else read_lax(LAX_INT, mt)
    if mt is not None and (n is None or n < 1):
        raise RequestError(
            400,
            f"'max_tokens' must be a positive integer, got {mt!r}",
            "BadRequestError",
            "client_error",
            "max_tokens",
        )
    return body
