"""FastChat's own ``fastchat.serve.openai_api_server`` (PyPI fschat 0.2.36) with one pydantic-v2 fix.

fschat 0.2.36, the newest on PyPI, streams with ``chunk.json(exclude_unset=True, ensure_ascii=False)``,
which pydantic 2 refuses (``TypeError: `dumps_kwargs` keyword arguments are no longer supported``: every
streamed request fails; lm-sys/FastChat issues #3043, #3140, #3299). Upstream fixed it after the release
(lm-sys/FastChat PR #3356, "migrate pydantic from v1 to v2": ``model_dump_json``); gearshift needs
pydantic 2. This launcher makes ``BaseModel.json`` take those keywords (``ensure_ascii=False`` is what
``model_dump_json`` does anyway) and then runs FastChat's module as ``python -m`` would, arguments
unchanged; nothing else of FastChat is touched.

Usage: python bench/fastchat_api.py --host 127.0.0.1 --port P --controller-address http://127.0.0.1:C
"""

from __future__ import annotations

import runpy
from typing import Any

import pydantic


def _json(self: pydantic.BaseModel, *, ensure_ascii: bool = False, **kwargs: Any) -> str:
    del ensure_ascii  # model_dump_json writes UTF-8 (ensure_ascii=False), FastChat's choice
    return self.model_dump_json(**kwargs)


def main() -> None:
    pydantic.BaseModel.json = _json  # type: ignore[method-assign,assignment]
    runpy.run_module("fastchat.serve.openai_api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
