"""Runs under the vLLM venv's python (not the project's): checks JSON bodies against vLLM's own code.

Started by ``tests/unit/vllm_ref.py``; reads one JSON object per line on stdin, answers one per line on
stdout. Operations:

- ``{"op": "request", "kind": "completion"|"chat", "body": {..}}``: validate with vLLM's
  ``CompletionRequest`` / ``ChatCompletionRequest`` (vllm/entrypoints/openai/protocol.py; split into
  openai/completion/protocol.py and openai/chat_completion/protocol.py by 0.32) and turn it into
  ``SamplingParams`` the way vLLM's serving layer does (``max_completion_tokens`` before ``max_tokens`` for
  chat); answers the fields vLLM ignored (``extra``), the effective ``max_tokens``/``min_tokens``,
  ``stream`` and the ``kv_transfer_params`` that reach the engine (``SamplingParams.extra_args``);
- ``{"op": "response", "kind": .., "body": {..}}``: validate with ``CompletionResponse`` /
  ``ChatCompletionResponse``; answers its ``kv_transfer_params`` and ``id``;
- ``{"op": "error", "body": {..}}``: validate with vLLM's ``ErrorResponse`` (vllm/entrypoints/serve/engine/
  protocol.py in 0.32, openai/protocol.py before), fields it does not define refused; answers the error;
- ``{"op": "nixl"}``: read NixlConnector's source (not imported: it needs NIXL) and answer the keys of
  the ``kv_transfer_params`` its scheduler's ``request_finished`` returns (``prefill_returns``) and the
  keys ``update_state_after_alloc`` requires to pull KV (``decode_requires``).

Any failure answers ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def _models() -> dict[str, Any]:
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
            ChatCompletionResponse,
        )
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
    except ImportError:  # vLLM before the split (0.11-0.1x): one protocol module
        from vllm.entrypoints.openai.protocol import (  # type: ignore[no-redef]
            ChatCompletionRequest,
            ChatCompletionResponse,
            CompletionRequest,
            CompletionResponse,
        )
    return {
        "completion": (CompletionRequest, CompletionResponse),
        "chat": (ChatCompletionRequest, ChatCompletionResponse),
    }


def _error(body: dict[str, Any]) -> dict[str, Any]:
    try:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    except ImportError:  # before 0.32's serve/ split
        from vllm.entrypoints.openai.protocol import ErrorResponse  # type: ignore[no-redef]
    err = ErrorResponse.model_validate(body)
    extra = sorted((err.model_extra or {}).keys()) + sorted((err.error.model_extra or {}).keys())
    return {"ok": True, "extra": extra, "error": err.error.model_dump()}


def _request(models: dict[str, Any], kind: str, body: dict[str, Any]) -> dict[str, Any]:
    req_cls = models[kind][0]
    req = req_cls.model_validate(body)
    if kind == "chat" and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
    sp = req.to_sampling_params(max_tokens, {})
    extra_args = sp.extra_args or {}
    return {
        "ok": True,
        "extra": sorted((req.model_extra or {}).keys()),
        "max_tokens": sp.max_tokens,
        "min_tokens": sp.min_tokens,
        "stream": bool(req.stream),
        "stream_options": req.stream_options.model_dump() if req.stream_options else None,
        "kv_transfer_params": extra_args.get("kv_transfer_params"),
    }


def _response(models: dict[str, Any], kind: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = models[kind][1].model_validate(body)
    return {"ok": True, "id": resp.id, "kv_transfer_params": resp.kv_transfer_params}


def _nixl_source() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    v1 = Path(next(iter(spec.submodule_search_locations))) / "distributed/kv_transfer/kv_connector/v1"
    for candidate in (v1 / "nixl" / "pull_scheduler.py", v1 / "nixl_connector.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no NixlConnector scheduler source under {v1}")


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"no function {name}")


def _nixl() -> dict[str, Any]:
    src = _nixl_source()
    tree = ast.parse(src.read_text())
    returned: list[str] = []
    for node in ast.walk(_function(tree, "request_finished")):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 2:
            call = node.value.elts[1]
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "dict":
                returned = [kw.arg for kw in call.keywords if kw.arg]
    required: list[str] = []
    for node in ast.walk(_function(tree, "update_state_after_alloc")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "all":
            gen = node.args[0] if node.args else None
            if isinstance(gen, ast.GeneratorExp) and isinstance(gen.generators[0].iter, ast.Tuple):
                required = [e.value for e in gen.generators[0].iter.elts if isinstance(e, ast.Constant)]
    if not returned:
        raise LookupError(f"{src}: request_finished returns no dict(...) of kv_transfer_params")
    return {"ok": True, "source": str(src), "prefill_returns": returned, "decode_requires": required}


def main() -> int:
    models = _models()
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg["op"]
            if op == "request":
                out = _request(models, msg["kind"], msg["body"])
            elif op == "response":
                out = _response(models, msg["kind"], msg["body"])
            elif op == "error":
                out = _error(msg["body"])
            elif op == "nixl":
                out = _nixl()
            else:
                out = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as exc:  # every failure goes back to the test
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
