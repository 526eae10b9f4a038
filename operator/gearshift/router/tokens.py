"""A prompt's length in tokens without a tokenizer: what the router's placement (KV bytes, prefill time)
reads from a request body. Pure.
"""

from __future__ import annotations

from typing import Any

#: Characters per token when the prompt is text (OpenAI's rule of thumb: ~4 characters per English token).
CHARS_PER_TOKEN = 4.0


def _text_tokens(text: str, mode: str) -> int:
    if mode == "words":
        return max(1, len(text.split()))
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def estimate_prompt_tokens(body: dict[str, Any], text_mode: str = "chars") -> int:
    """Prompt length in tokens: exact for token-id prompts; for text ``chars / 4`` (OpenAI's rule of thumb,
    ``text_mode="chars"``) or one token per word (``"words"``: gearshift-sim's count, no tokenizer)."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        text = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        return _text_tokens(text, text_mode)
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if prompt and isinstance(prompt[0], list):
            return max(1, sum(len(p) for p in prompt))
        return _text_tokens(" ".join(str(p) for p in prompt), text_mode)
    return _text_tokens(str(prompt or ""), text_mode)
