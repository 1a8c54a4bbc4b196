"""Anthropic's "preserved thinking" prefix check, as the fake upstream enforces it: value types
and functions, no I/O, so the fake and in-process tests share one checker.

Newer Claude models (Fable 5.x, Mythos 5.x, Opus / Sonnet / Haiku 5.5) bind each signed
``thinking`` / ``redacted_thinking`` block to its *prefix*: the top-level ``system`` and
``tools``, every earlier message, and the earlier blocks of its own message. A block whose prefix
differs from the one it was produced after is invalid, and the API answers 400
(:func:`mismatch_message`), or, with the ``thinking-binding-controls-2026-08-01`` beta and
``thinking.block_binding.prefix_mismatch_behavior: "drop_block"``, removes the invalid blocks
and reports each in the answer's ``input_transformations``.

Each block is checked on its own against the prefix it was bound to, which gives the documented
outcomes: a change invalidates every block produced before it and placed after it (their
prefixes held the old value), while blocks before the change and blocks produced after it stay
valid; leaving out or moving a thinking block between others invalidates the later ones (their
prefixes held it); leaving out all of them leaves nothing to check. ``cache_control`` markers
are not part of a prefix (stripped everywhere); JSON whitespace and key order do not matter
(canonical values are compared), any value change does. A string ``content`` (of ``system``, a
message, a ``tool_result``) is the API's shorthand for one text block and compares equal to it:
Claude Code sends its newest ``role: "system"`` message as blocks and the same message as a
string from the next request on, and the docs count Claude Code as append-only.

The :class:`Binder` issues the signatures (base64 of a magic, the prefix digest and the thinking
text, so :func:`.fake_wire.reasoning_of_token` still recovers the text) and remembers each one
with the digests of its prefix's parts: a signature it never issued is refused too, and a
failure can name the first part that changed (for diagnosis; the 400 says only where).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from proxy.demo.fake.wire import bound_reasoning_token
from proxy.formats.messages.request import strip_cache_control

__all__ = [
    "BETA",
    "HEADER_REQUIRED_MESSAGE",
    "THINKING_TYPES",
    "Binder",
    "Binding",
    "Failure",
    "beta_enabled",
    "block_binding_of",
    "mismatch_message",
    "strip_cache_control",
]

#: the beta that enables ``thinking.block_binding``
BETA = "thinking-binding-controls-2026-08-01"
THINKING_TYPES = frozenset({"thinking", "redacted_thinking"})
HEADER_REQUIRED_MESSAGE = (
    "thinking.block_binding: This setting requires the `thinking-binding-controls-2026-08-01` "
    "value in the `anthropic-beta` header."
)

Reason = Literal["prefix_mismatch", "thinking_changed", "unknown_signature"]


def mismatch_message(message_index: int, content_index: int) -> str:
    """The 400's message for the first failing block, as the API words it."""
    return (
        f"messages.{message_index}.content.{content_index}: Invalid `signature` in `thinking` "
        "block. The block is bound to a different conversation. Remove the block, or set "
        '`thinking.block_binding.prefix_mismatch_behavior` to "drop_block".'
    )




def _text_blocks(content: Any) -> Any:
    """``content`` with the string shorthand spelled as the one text block it stands for."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [_block(b) for b in content]
    return content


def _block(block: Any) -> Any:
    if isinstance(block, dict) and block.get("type") == "tool_result" and "content" in block:
        return {**block, "content": _text_blocks(block["content"])}
    return block


def _message(message: Any) -> Any:
    if isinstance(message, dict) and "content" in message:
        return {**message, "content": _text_blocks(message["content"])}
    return message


def _digest(tag: bytes, value: Any) -> bytes:
    canonical = orjson.dumps(strip_cache_control(value), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(tag + b"\0" + canonical).digest()


def beta_enabled(headers: Mapping[str, str]) -> bool:
    """Whether ``anthropic-beta`` (lower-cased names; a comma-separated list, repeated headers
    joined) names :data:`BETA`."""
    return BETA in (b.strip() for b in headers.get("anthropic-beta", "").split(","))


def block_binding_of(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """``thinking.block_binding`` of a request, None when it has none."""
    thinking = body.get("thinking")
    binding = thinking.get("block_binding") if isinstance(thinking, dict) else None
    return binding if isinstance(binding, dict) else None


@dataclass(frozen=True, slots=True)
class Failure:
    """One thinking block that fails the check, where it is in the request, and why."""

    message_index: int
    content_index: int
    reason: Reason
    #: the first part of the prefix that differs from the bound one ("system", "tools",
    #: "messages.3", "messages.5.content.0", "messages.5.role"), when the binder knows it
    changed: str | None = None

    @property
    def path(self) -> str:
        return f"messages.{self.message_index}.content.{self.content_index}"

    @property
    def message(self) -> str:
        return mismatch_message(self.message_index, self.content_index)

    def transformation(self) -> dict[str, str]:
        """The ``input_transformations`` entry reporting this block's removal (the SDK's
        ``BetaThinkingDroppedInputTransformation``)."""
        return {"type": "thinking_dropped", "path": self.path, "reason": "prefix_binding_mismatch"}


@dataclass(frozen=True, slots=True)
class Binding:
    """What an issued signature is bound to: the prefix digest, the digests of the prefix's
    parts (with their names, for diagnosis) and the thinking text."""

    digest: bytes
    parts: tuple[tuple[str, bytes], ...]
    thinking: str


class _Prefixes:
    """The part digests of one request's prefixes, each part hashed once."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        messages = body.get("messages")
        self.messages: list[Any] = messages if isinstance(messages, list) else []
        self._head = (
            ("system", _digest(b"system", _text_blocks(body.get("system")))),
            ("tools", _digest(b"tools", body.get("tools"))),
        )
        self._message_digests: list[bytes] = []

    def _message(self, n: int) -> bytes:
        while len(self._message_digests) <= n:
            i = len(self._message_digests)
            self._message_digests.append(_digest(b"message", _message(self.messages[i])))
        return self._message_digests[n]

    def parts(
        self, n: int, role: Any, blocks: Sequence[Any]
    ) -> tuple[tuple[str, bytes], ...]:
        """The parts before block ``len(blocks)`` of message ``n`` (``role``, its earlier
        ``blocks``); ``n`` may be ``len(messages)``: a new message after them."""
        out = list(self._head)
        out += [(f"messages.{i}", self._message(i)) for i in range(n)]
        out.append((f"messages.{n}.role", _digest(b"role", role)))
        out += [
            (f"messages.{n}.content.{j}", _digest(b"block", _block(b))) for j, b in enumerate(blocks)
        ]
        return tuple(out)


def _prefix_digest(parts: tuple[tuple[str, bytes], ...]) -> bytes:
    return hashlib.sha256(b"".join(d for _, d in parts)).digest()


def _thinking_blocks(messages: list[Any]) -> Iterator[tuple[int, int, dict[str, Any], Any]]:
    """``(n, m, block, message role)`` of every thinking block, in request order."""
    for n, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for m, block in enumerate(content):
            if isinstance(block, dict) and block.get("type") in THINKING_TYPES:
                yield n, m, block, msg.get("role")


class Binder:
    """Issues bound signatures and checks the thinking blocks of a request against them.

    Remembers every signature it issued (a test session's worth: a few hundred entries);
    :meth:`clear` forgets them, and then every earlier block is refused as never issued."""

    def __init__(self) -> None:
        self._issued: dict[str, Binding] = {}

    def __len__(self) -> int:
        return len(self._issued)

    def __contains__(self, signature: object) -> bool:
        return signature in self._issued

    def clear(self) -> None:
        self._issued.clear()

    def sign(
        self, body: Mapping[str, Any], thinking: str, *, before: Sequence[Any] = ()
    ) -> str:
        """The signature of a thinking block saying ``thinking`` in the assistant message that
        answers ``body`` (after its ``messages``, as the request had them), after that
        message's own blocks ``before``."""
        prefixes = _Prefixes(body)
        parts = prefixes.parts(len(prefixes.messages), "assistant", before)
        digest = _prefix_digest(parts)
        signature = bound_reasoning_token(digest, thinking)
        self._issued[signature] = Binding(digest, parts, thinking)
        return signature

    def binding(self, signature: str) -> Binding | None:
        return self._issued.get(signature)

    def check(self, body: Mapping[str, Any]) -> list[Failure]:
        """Every thinking block of ``body`` that fails, in request order (empty: it passes);
        the first one is what the 400 names."""
        prefixes = _Prefixes(body)
        failures = []
        for n, m, block, role in _thinking_blocks(prefixes.messages):
            signature = block.get("signature") if block.get("type") == "thinking" else None
            bound = self._issued.get(signature) if isinstance(signature, str) else None
            if bound is None:
                failures.append(Failure(n, m, "unknown_signature"))
                continue
            parts = prefixes.parts(n, role, prefixes.messages[n]["content"][:m])
            if _prefix_digest(parts) != bound.digest:
                failures.append(Failure(n, m, "prefix_mismatch", _first_change(bound.parts, parts)))
            elif block.get("thinking") != bound.thinking:
                failures.append(Failure(n, m, "thinking_changed", f"messages.{n}.content.{m}"))
        return failures

    def drop(
        self, body: Mapping[str, Any], failures: Sequence[Failure] | None = None
    ) -> tuple[dict[str, Any], list[dict[str, str]]]:
        """``body`` without its failing thinking blocks (a copy; ``failures`` from
        :meth:`check`, computed when not given), and the ``input_transformations`` reporting
        each removal, in request order."""
        found = self.check(body) if failures is None else list(failures)
        out = copy.deepcopy(dict(body))
        by_message: dict[int, set[int]] = {}
        for f in found:
            by_message.setdefault(f.message_index, set()).add(f.content_index)
        for n, drop in by_message.items():
            msg = out["messages"][n]
            msg["content"] = [b for j, b in enumerate(msg["content"]) if j not in drop]
        return out, [f.transformation() for f in found]


def _first_change(
    bound: tuple[tuple[str, bytes], ...], now: tuple[tuple[str, bytes], ...]
) -> str:
    """The name of the first part where ``now`` differs from ``bound`` (an extra or missing
    part counts: a message or block added or removed before the block)."""
    for (name, d_bound), (name_now, d_now) in zip(bound, now, strict=False):
        if name != name_now:
            return name_now  # one prefix has more messages before the block: it moved
        if d_bound != d_now:
            return name
    longer = now if len(now) > len(bound) else bound
    return longer[min(len(bound), len(now))][0]
