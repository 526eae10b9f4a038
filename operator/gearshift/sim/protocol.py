"""What vLLM puts in its answers for PD, as the simulator answers it (docs/ARCHITECTURE.md): response and
engine request ids (vLLM's serving layer), and NixlConnector's ``kv_transfer_params``: a request with
``kv_transfer_params.do_remote_decode`` is prefilled and answered after one token with the
:func:`prefill_kv_transfer_params` a decode pod needs; a request with valid
``kv_transfer_params.do_remote_prefill`` (:func:`remote_prefill_tokens`) skips prefill and pulls its
prompt's KV over the KV link first. Pure.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from gearshift.sim.request import ParsedRequest

#: vLLM's default NIXL side-channel port, ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (vllm/envs.py), which a prefill
#: pod's ``kv_transfer_params`` name as ``remote_port`` (the simulator opens no side channel).
NIXL_SIDE_CHANNEL_PORT = 5600
#: What a decode request's ``kv_transfer_params`` must hold besides non-empty ``remote_block_ids`` for
#: vLLM to pull the KV (``update_state_after_alloc`` in
#: vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py, 0.32).
REMOTE_PREFILL_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def response_id(headers: Mapping[str, str], pr: ParsedRequest, chat: bool) -> str:
    """The response ``id``: ``cmpl-<id>`` or ``chatcmpl-<id>``, ``<id>`` being the ``X-Request-Id``
    header, else the body's ``request_id``, else a new one (vLLM's serving layer: ``_base_request_id``
    in vllm/entrypoints/serve/engine/serving.py, used by openai/completion/serving.py and
    openai/chat_completion/serving.py)."""
    base = headers.get("X-Request-Id") or pr.request_id or uuid.uuid4().hex
    return ("chatcmpl-" if chat else "cmpl-") + base


def engine_request_id(rid: str, chat: bool) -> str:
    """The engine's internal id of a request whose response id is ``rid``: completions add the prompt's
    index (``f"{request_id}-{i}"``, vllm/entrypoints/openai/completion/serving.py), and the engine adds 8
    random characters (``assign_request_id`` in vllm/v1/engine/input_processor.py). A prefill pod returns
    it as ``remote_request_id``."""
    return f"{rid if chat else rid + '-0'}-{uuid.uuid4().hex[:8]}"


def prefill_kv_transfer_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    block_ids: Sequence[int],
    num_tokens: int,
    tp_size: int,
    pp_size: int,
) -> dict[str, Any]:
    """What a prefill pod answers a ``do_remote_decode`` request with: the dict NixlConnector's scheduler
    returns from ``request_finished`` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py,
    0.32; nixl_connector.py before), key for key. ``remote_block_ids`` holds one list per KV-cache group
    (one group here: every layer is full attention); ``remote_host``/``remote_port`` are the pod's NIXL side
    channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``, the pod IP, and :data:`NIXL_SIDE_CHANNEL_PORT`);
    ``tp_size`` is the GPUs of a stage (vLLM: the same TP on every stage)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": NIXL_SIDE_CHANNEL_PORT,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": pp_size,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }


def remote_prefill_tokens(ktp: Mapping[str, Any], prompt_tokens: int) -> int:
    """Prompt tokens whose KV a decode request pulls instead of computing: all of them when
    ``kv_transfer_params`` asks for a remote prefill and names the blocks and where they are, else 0 (vLLM
    logs "Got invalid KVTransferParams" and the request does not use KV transfer). vLLM counts the decode
    request's own prompt, not a number sent along (``get_num_new_matched_tokens`` and
    ``update_state_after_alloc`` in vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py)."""
    if not ktp.get("do_remote_prefill"):
        return 0
    if not ktp.get("remote_block_ids") or not all(k in ktp for k in REMOTE_PREFILL_KEYS):
        return 0
    return prompt_tokens
