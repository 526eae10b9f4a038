"""JSON request values read as vLLM's OpenAI request models read them.

vLLM's request models are pydantic models in lax mode (vllm/entrypoints/openai/completion/protocol.py and
chat_completion/protocol.py, 0.32): ``"stream": "yes"`` is true and ``"false"`` false, ``"max_tokens":
"5"`` is 5, ``"temperature": "0.5"`` is 0.5, ``"hot"`` is refused. The simulated engine and the router
read the fields they act on the same way, so a request means the same to them as to vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pydantic

LAX_BOOL: pydantic.TypeAdapter[bool] = pydantic.TypeAdapter(bool)
LAX_INT: pydantic.TypeAdapter[int] = pydantic.TypeAdapter(int)
LAX_FLOAT: pydantic.TypeAdapter[float] = pydantic.TypeAdapter(float)


#: The type each adapter above returns: a value of exactly that type is returned as it is (exactly: a bool,
#: a subclass of int, still goes through pydantic).
_EXACT: Mapping[int, type] = MappingProxyType({id(LAX_BOOL): bool, id(LAX_INT): int, id(LAX_FLOAT): float})


def read_lax(adapter: pydantic.TypeAdapter[Any], value: Any) -> Any:
    """``value`` through ``adapter`` in lax mode; None when vLLM's models would refuse it (none of the
    adapters above returns None for a value they take). A value already of the adapter's type is returned
    as it is, without pydantic (the router reads ``stream`` of every request)."""
    if type(value) is _EXACT.get(id(adapter)):
        return value
    try:
        return adapter.validate_python(value)
    except pydantic.ValidationError:
        return None
