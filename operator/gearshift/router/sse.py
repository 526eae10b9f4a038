"""The server-sent events of an engine's answer: which events carry tokens, the finish reason and the
``usage`` they report, and the usage chunk the router asks for and keeps from a client that did not.
Pure: bytes in, counts and bytes out; :mod:`gearshift.router.relay` copies the stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gearshift.facts import fastjson
from gearshift.facts.lax import LAX_BOOL, read_lax


def _read_choices(doc: dict[str, Any]) -> tuple[bool, str | None]:
    """Of a completion document's ``choices``: whether one carries content (``text``, or chat's
    ``delta.content`` / ``reasoning_content`` / ``tool_calls``) and the first string ``finish_reason``.
    Exact ``dict``/``list`` checks, not ``Mapping``: JSON parses to them, and an ABC check costs more than
    the parse on the per-event path."""
    choices = doc.get("choices")
    if type(choices) is not list:
        return False, None
    content, reason = False, None
    for choice in choices:
        if type(choice) is not dict:
            continue
        if not content:
            delta = choice.get("delta")
            content = bool(
                choice.get("text")
                or (
                    type(delta) is dict
                    and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
                )
            )
        if reason is None and type(fr := choice.get("finish_reason")) is str:
            reason = fr
    return content, reason


@dataclass
class StreamScan:
    """What the complete server-sent events of a stream's bytes say: token events, and the last
    ``finish_reason`` and ``usage`` seen."""

    tokens: int = 0
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None
    done: bool = False
    """``data: [DONE]`` seen: the answer is complete (a client may close its connection now)."""


def scan_sse(buffer: bytes) -> tuple[StreamScan, bytes]:
    """Scan the complete server-sent events in ``buffer``; return what they say and the unfinished tail
    (bytes after the last blank line) to prepend to the next chunk.

    A token event is a ``data:`` JSON chunk with a non-empty ``choices[].text`` (completions) or
    ``choices[].delta.content`` / ``reasoning_content`` / ``tool_calls`` (chat). Not tokens: chat's first
    chunk, which carries only the role (vLLM sends it before the first token is computed, so a TTFT timed
    from it is too low), a usage-only chunk (``choices: []``), ``[DONE]`` and anything that is not JSON.
    """
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    scan = StreamScan()
    for ev in events:
        # vLLM's events are one ``data:`` line each: the common case skips the line split.
        lines = (ev,) if b"\n" not in ev else ev.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                scan.done = True
                continue
            if not payload:
                continue
            try:
                doc = fastjson.loads(payload)
            except ValueError:
                continue
            if type(doc) is not dict:
                continue
            content, reason = _read_choices(doc)
            if content:
                scan.tokens += 1
            scan.finish_reason = reason or scan.finish_reason
            usage = doc.get("usage")
            if type(usage) is dict:
                scan.usage = usage
    return scan, rest


def usage_withheld(body: Mapping[str, Any]) -> bool:
    """Whether a streamed request asked for no usage chunk (no ``stream_options.include_usage``): the
    router then asks the engine for one anyway (:func:`with_usage_requested`), counts its tokens, and keeps
    it from the client (:func:`complete_events`), so the token series count every stream."""
    if not read_lax(LAX_BOOL, body.get("stream") or False):
        return False
    opts = body.get("stream_options")
    if opts is None:
        return True
    if not isinstance(opts, Mapping):
        return False  # not vLLM's StreamOptions: the engine refuses the request, leave it as it came
    include = read_lax(LAX_BOOL, opts.get("include_usage") or False)
    # None: a value vLLM refuses ("maybe"); the engine answers it with its 400, so the body goes as it came.
    return include is False


def with_usage_requested(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with ``stream_options.include_usage: true`` (vLLM's ``should_include_usage``,
    vllm/entrypoints/serve/utils/api_utils.py: one usage-only chunk before ``[DONE]``, no usage on the
    others: ``continuous_usage_stats`` is dropped); ``body`` itself is not changed."""
    given = body.get("stream_options")
    opts = dict(given) if isinstance(given, Mapping) else {}
    # Without include_usage the client's continuous_usage_stats did nothing; with it, every chunk would
    # carry usage the client did not ask for.
    opts.pop("continuous_usage_stats", None)
    return {**body, "stream_options": {**opts, "include_usage": True}}


def _usage_only(event: bytes) -> bool:
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                doc = fastjson.loads(line[5:])
            except ValueError:
                return False
            return (
                isinstance(doc, Mapping)
                and doc.get("choices") == []
                and isinstance(doc.get("usage"), Mapping)
            )
    return False


def complete_events(buffer: bytes, drop_usage: bool) -> tuple[bytes, bytes]:
    """Split ``buffer`` into its complete server-sent events (to write now) and the unfinished tail (to
    prepend to the next chunk), as :func:`scan_sse` splits it; with ``drop_usage``, usage-only chunks
    (``choices: []``) are left out of what is written."""
    if not drop_usage and b"\r" not in buffer:
        # Nothing to leave out: cut after the last blank line, no split (the bytes are the same).
        cut = buffer.rfind(b"\n\n") + 2
        return (buffer[:cut], buffer[cut:]) if cut >= 2 else (b"", buffer)
    *events, rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    if drop_usage:
        events = [ev for ev in events if not _usage_only(ev)]
    return b"".join(ev + b"\n\n" for ev in events), rest


def body_scan(data: bytes) -> StreamScan:
    """:class:`StreamScan` of a whole (unstreamed) completion body."""
    try:
        doc = fastjson.loads(data)
    except ValueError:
        return StreamScan()
    if type(doc) is not dict:
        return StreamScan()
    usage = doc.get("usage")
    content, reason = _read_choices(doc)
    return StreamScan(int(content), reason, usage if type(usage) is dict else None)
