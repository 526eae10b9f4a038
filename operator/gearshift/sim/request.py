"""An OpenAI completions or chat body, read as vLLM reads it: the fields the simulated engine uses, and a
400 (:class:`BadRequest`, naming the field) for what vLLM refuses or the simulator does not produce. Pure.

Token counting (the simulator has no tokenizer): a ``prompt`` given as a list of token ids counts one
token per id, exactly as vLLM does; text counts one token per whitespace-separated word (for chat, the
words of every message's content). Output is the word ``tok`` once per generated token
(:data:`TOKEN_TEXT`), so a client counting words gets the same count. There is no EOS: a request always
generates ``max_tokens`` tokens (vLLM with ``ignore_eos: true``); ``max_tokens`` defaults to 16 for
completions (OpenAI's default) and :data:`DEFAULT_CHAT_MAX_TOKENS` for chat.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from gearshift.facts.lax import LAX_BOOL, LAX_FLOAT, LAX_INT, read_lax

DEFAULT_CHAT_MAX_TOKENS = 256
TOKEN_TEXT = " tok"


@dataclass(frozen=True)
class ParsedRequest:
    """What the engine needs from an OpenAI request body."""

    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str | None
    kv_transfer_params: Mapping[str, Any] | None
    request_id: str | None = None
    """The body's ``request_id`` (vLLM's own field; the ``X-Request-Id`` header comes first)."""
    stop: tuple[str, ...] = ()
    """``stop`` strings: the output ends before the first one (after it with ``include_stop``)."""
    include_stop: bool = False
    """``include_stop_str_in_output`` (vLLM's extra field)."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats`` with ``include_usage``: every chunk carries the usage so
    far (vLLM's ``should_include_usage``, vllm/entrypoints/serve/utils/api_utils.py)."""


class BadRequest(ValueError):
    """A malformed request body; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _count_text(text: str) -> int:
    return len(text.split())


def count_prompt_tokens(prompt: Any) -> int:
    """Tokens of a completions ``prompt``: ids in a list of ints, else words of the text.

    Raises:
        BadRequest: a batch of prompts (a list of strings or of lists) or a wrong type.
    """
    if isinstance(prompt, str):
        return _count_text(prompt)
    if isinstance(prompt, list):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return count_prompt_tokens(prompt[0])
        raise BadRequest("batched prompts are not supported by the simulator; send one per request", "prompt")
    raise BadRequest("prompt must be a string or a list of token ids", "prompt")


def count_chat_tokens(messages: Any) -> int:
    """Tokens of chat ``messages``: the words of every message's text content.

    Raises:
        BadRequest: ``messages`` not a non-empty list of ``{role, content}`` objects.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    total = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object with role and content", "messages")
        content = msg.get("content")
        if isinstance(content, str):
            total += _count_text(content)
        elif isinstance(content, list):
            total += sum(_count_text(p.get("text", "")) for p in content if isinstance(p, dict))
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", "messages")
    return total


#: Fields that change what a completion returns and the simulator does not produce, with the values that
#: ask for nothing (vLLM's defaults): a request asking for more is refused naming the field, not answered
#: as if it had been applied.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
    "stop_token_ids": (None, []),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
}

INCLUDE_STOP = "include_stop_str_in_output"

#: Sampling fields the simulator does not use but checks as vLLM does, so a request vLLM refuses is refused
#: here too: name → (type, the range vLLM allows, that range in vLLM's words). Types from vLLM's request
#: models (pydantic, lax), ranges from ``SamplingParams._verify_args`` (vllm/sampling_params.py, 0.32).
SAMPLING_RULES: dict[str, tuple[pydantic.TypeAdapter[Any], Callable[[Any], bool], str]] = {
    "temperature": (LAX_FLOAT, lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": (LAX_FLOAT, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (LAX_INT, lambda v: v in (-1, 0) or v >= 1, "0 (disable), or at least 1"),
    "min_p": (LAX_FLOAT, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "presence_penalty": (LAX_FLOAT, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (LAX_FLOAT, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (LAX_FLOAT, lambda v: v > 0, "greater than zero"),
    "seed": (LAX_INT, lambda _v: True, "an integer"),
    "ignore_eos": (LAX_BOOL, lambda _v: True, "a boolean"),
    "skip_special_tokens": (LAX_BOOL, lambda _v: True, "a boolean"),
    "min_tokens": (LAX_INT, lambda v: v >= 0, "greater than or equal to 0"),
}


def check_sampling(body: Mapping[str, Any], max_tokens: int) -> None:
    """Refuse what vLLM refuses among :data:`SAMPLING_RULES`' fields (None is vLLM's default: passes),
    and a ``min_tokens`` above ``max_tokens``.

    Raises:
        BadRequest: naming the field, in vLLM's words.
    """
    for name, (adapter, allowed, rule) in SAMPLING_RULES.items():
        if body.get(name) is None:
            continue
        value = _lax(adapter, body[name], name, "a number" if adapter is LAX_FLOAT else rule)
        if not allowed(value):
            raise BadRequest(f"{name} must be {rule}, got {value}.", name)
        if name == "min_tokens" and value > max_tokens:
            raise BadRequest(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {value}.", name
            )


def _lax(adapter: pydantic.TypeAdapter[Any], value: Any, field: str, what: str) -> Any:
    """``value`` read as vLLM reads it (:func:`gearshift.facts.lax.read_lax`).

    Raises:
        BadRequest: naming ``field``.
    """
    read = read_lax(adapter, value)
    if read is None:
        raise BadRequest(f"{field} must be {what}, got {value!r}", field)
    return read


def stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage)`` of a request's ``stream_options``, read as vLLM reads them:
    an object of lax booleans (``StreamOptions``, vllm/entrypoints/generate/base/protocol.py, 0.32; the
    string ``"false"`` is False), continuous usage only with ``include_usage`` (``should_include_usage``).

    Raises:
        BadRequest: ``stream_options`` given (truthy) on a request whose raw ``stream`` is falsy, with
            vLLM's message (its ``validate_stream_options`` before-validator tests the raw values, so
            ``"stream": "false"`` lets options through and ``{}`` passes with ``stream: false``); not an
            object; a value that is not a boolean.
    """
    opts = body.get("stream_options")
    if opts and not body.get("stream"):
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise BadRequest(
            f'stream_options must be an object such as {{"include_usage": true}}, got {opts!r}',
            "stream_options",
        )
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        raw = opts.get(name)
        value = False if raw is None else read_lax(LAX_BOOL, raw)
        if value is None:
            raise BadRequest(f"stream_options.{name} must be a boolean, got {raw!r}", "stream_options")
        flags.append(bool(value))
    return flags[0], flags[0] and flags[1]


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(v for v in value if v)
    raise BadRequest(f"stop must be a string or a list of strings, got {value!r}", "stop")


def stop_point(stop: Sequence[str], max_tokens: int, include_stop: bool = False) -> tuple[int, int] | None:
    """Where ``stop`` ends the simulator's output (``TOKEN_TEXT`` repeated): ``(tokens, chars)``, the
    tokens generated up to the one that completes the first stop string and the characters of text
    returned (up to that string, or through it with ``include_stop``), as vLLM's detokenizer stops
    (vllm/v1/engine/detokenizer.py ``check_stop_strings``); None when no stop string occurs within
    ``max_tokens`` tokens."""
    best: tuple[int, int] | None = None
    for s in stop:
        # The output is periodic: a string that occurs at all occurs within its length plus two tokens.
        for k in range(1, min(max_tokens, len(s) // len(TOKEN_TEXT) + 2) + 1):
            at = (TOKEN_TEXT * k).find(s)
            if at >= 0:
                cut = at + len(s) if include_stop else at
                if best is None or (k, cut) < best:
                    best = (k, cut)
                break
    return best


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Read the fields the simulator uses from a completions (``chat=False``) or chat body.

    Raises:
        BadRequest: naming the field.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = count_chat_tokens(body.get("messages")) if chat else count_prompt_tokens(body.get("prompt"))
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = DEFAULT_CHAT_MAX_TOKENS if chat else 16
    max_tokens = body.get(key)
    max_tokens = default if max_tokens is None else _lax(LAX_INT, max_tokens, key, "a positive integer")
    if max_tokens < 1:
        raise BadRequest(f"{key} must be a positive integer, got {max_tokens!r}", key)
    check_sampling(body, max_tokens)
    if _lax(LAX_INT, body.get("n", 1), "n", "an integer") != 1:
        raise BadRequest(
            "n: gearshift-sim returns one choice per request; send n=1 (or several requests)", "n"
        )
    for name, neutral in UNSUPPORTED_FIELDS.items():
        # by type as well: completions' logprobs=0 asks for the sampled token's logprob (0 == False)
        if name in body and not any(body[name] == n and type(body[name]) is type(n) for n in neutral):
            raise BadRequest(
                f"{name} is not supported by gearshift-sim (it returns placeholder text of the right length "
                "and timing); leave it out, or serve the model with engine: vllm",
                name,
            )
    include_usage, continuous_usage = stream_options(body)
    ktp = body.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise BadRequest("kv_transfer_params must be an object", "kv_transfer_params")
    model = body.get("model")
    rid = body.get("request_id")
    return ParsedRequest(
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        stream=_lax(LAX_BOOL, body.get("stream") or False, "stream", "a boolean"),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        model=model if isinstance(model, str) else None,
        kv_transfer_params=ktp,
        request_id=rid if isinstance(rid, str) and rid else None,
        stop=_stop_strings(body.get("stop")),
        include_stop=_lax(
            LAX_BOOL,
            body.get("include_stop_str_in_output") or False,
            "include_stop_str_in_output",
            "a boolean",
        ),
    )
