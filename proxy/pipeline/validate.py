"""Tool-call pairing validator and repair (docs/compaction.md#validation): pure.

The provider rejects a request whose tool messages are not paired with the calls that caused
them ("An assistant message with 'tool_calls' must be followed by tool messages responding to
each 'tool_call_id'", and the converse for a tool message without its call). The proxy's own
changes (compaction evicting a call, eviction, the last resort) can produce such lists, so the
proxy checks every outgoing list and repairs what *it* broke rather than send something that is
certain to fail.

It never repairs the client's own mistakes. :func:`validate` is given the client's list
(``sent``): a break that list already has (an orphan result, an unanswered call, a
``tool_calls`` the rules refuse) is left exactly as the client sent it, for the provider to
judge; so a request nothing else changed goes upstream byte for byte, whatever its pairing.
A break is the client's when the client's list has the same one: an orphan result with the
same ``tool_call_id``, an unanswered call with the same id, as many times as the client's list
has it (a cut result is a copy of the client's, with its id). A break of the proxy's making
that happens to look like one of the client's is left alone too: the provider would refuse the
client's own list for the same reason.

Validity (what :func:`is_valid` checks and :func:`validate` guarantees on its output). The list
is read as a sequence of *result blocks*: an ``assistant`` message followed by the maximal run of
``tool``/``function`` messages after it.

* An assistant's ``tool_calls`` is absent, ``None``, or a non-empty list of dicts each with a
  string ``id`` (the API rejects ``tool_calls: []`` with "empty array").
* Every ``tool`` message sits in the block of an assistant with ``tool_calls`` and its
  ``tool_call_id`` is one of that assistant's call ids; each call id is answered exactly once
  (an id that occurs k times in one message needs k results) before the next non-result message
  or the end of the list. So a trailing assistant with unanswered calls is invalid too: the
  provider rejects it as well.
* Legacy: every ``function`` message sits in the block of an assistant with a ``function_call``,
  which gets exactly one such result in its block.
* Nothing is checked across blocks: ids may repeat in later turns (some servers number calls
  ``call_0``, ``call_1``... in every turn), and a result is only ever matched within its block.

Repairs of the proxy's breaks, in order of the input (indices in the repair notes refer to the
input list):

* malformed entries of ``tool_calls`` (not a dict, or no string ``id``) are dropped; a
  ``tool_calls`` that ends up empty (or was ``[]``, or was not a list) is removed, and a
  ``content`` of ``None`` becomes ``""`` so that the message stays acceptable;
* a ``tool``/``function`` result with no matching pending call in its block (orphaned: its call
  was evicted or deleted, it answers an id already answered, or it comes after another message)
  is dropped — the original is archived by the dialog store, so nothing is lost;
* every call still unanswered when its block ends gets a synthetic result right after the
  block's existing results, in ``tool_calls`` order: ``{"role": "tool", "tool_call_id": id,
  "content": PLACEHOLDER}`` (legacy: ``{"role": "function", "name": name, "content":
  PLACEHOLDER}``).

Anthropic Messages (``request.api == "messages"``) adds one rule: the conversation after the
leading system block starts with a user message. A compaction whose kept suffix starts with an
assistant turn (the agent loop is cut mid-way, so its user request is in the summary) gets a
short user message, :data:`BRIDGE`, in front of it (the Messages writer puts the summary's text
before it in that message); everything else about pairs is the same
(a ``tool_result`` answers a ``tool_use`` of the message right before it, which in this model is
a tool message following its assistant message).

Misplaced results are deliberately not moved to the turn of their call: with ids reused across
turns the target would be a guess, and a placeholder is honest.

The output list shares every unchanged message dict with the input; repaired assistant messages
are shallow copies. The input list and its dicts are never mutated.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.model import Message, RequestView, StageOutcome

_log = logging.getLogger("proxy.pipeline")


__all__ = ["BRIDGE", "PLACEHOLDER", "Validation", "is_valid", "starts_with_user", "validate"]

PLACEHOLDER = "[ctxproxy: no result was recorded for this call]"
BRIDGE = ("[ctxproxy: the earlier turns of this conversation were compacted; continue from where "
          "it left off]")
_LEADING = frozenset({"system", "developer"})
_SHOWN_REPAIRS = 5  # a log line names the first repairs only (a client controls how many)


def starts_with_user(messages: list[Message]) -> Validation:
    """Messages' rule: the first message after the leading system block is not an assistant
    turn (see the module docstring); the very list when it holds."""
    head = 0
    while head < len(messages) and messages[head].get("role") in _LEADING:
        head += 1
    first = next((m for m in messages[head:] if m.get("role") not in _LEADING), None)
    if first is None or first.get("role") != "assistant":
        return Validation(messages, (), False)
    bridge = {"role": "user", "content": [{"type": "text", "text": BRIDGE}]}
    return Validation([*messages[:head], bridge, *messages[head:]],
                      ("inserted a user message before the first (assistant) turn",), True)


@dataclass(frozen=True, slots=True)
class Validation:
    messages: list[Message]
    repairs: tuple[str, ...]
    changed: bool


def is_valid(messages: Sequence[Message]) -> bool:
    """True when the list satisfies the pairing rules. O(n), allocates only per-block id counts."""
    # pending: ids of the current block still owed a result, with multiplicity; None outside a
    # tool_calls block. An empty dict is a block whose calls are all answered.
    pending: dict[str, int] | None = None
    function_pending = False
    for message in messages:
        role = message.get("role")
        if role == "tool":
            if not pending:
                return False
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                return False
            left = pending.get(call_id)
            if not left:
                return False
            if left == 1:
                del pending[call_id]
            else:
                pending[call_id] = left - 1
        elif role == "function":
            if not function_pending:
                return False
            function_pending = False
        else:
            if pending or function_pending:
                return False
            pending = None
            if role == "assistant":
                calls = message.get("tool_calls")
                if calls is not None:
                    if not isinstance(calls, list) or not calls:
                        return False
                    pending = {}
                    for call in calls:
                        call_id = call.get("id") if isinstance(call, dict) else None
                        if not isinstance(call_id, str):
                            return False
                        pending[call_id] = pending.get(call_id, 0) + 1
                function_pending = message.get("function_call") is not None
    return not pending and not function_pending


def _function_name(message: Message) -> str:
    call = message.get("function_call")
    name = call.get("name") if isinstance(call, dict) else None
    return name if isinstance(name, str) and name else "unknown"


def validate(messages: list[Message], sent: Sequence[Message] | None = None) -> Validation:
    """Check and, when needed, repair the pairing rules (see the module docstring); with
    ``sent`` (the client's own list) only the breaks ``sent`` does not have are repaired.

    A list left as it is is returned as the very same object with ``changed=False``.
    """
    if is_valid(messages):
        return Validation(messages, (), False)
    tolerated: Counter[Hashable] = Counter()
    if sent is not None:
        if sent is messages:
            return Validation(messages, (), False)
        _repair(list(sent), tolerated, Counter())
    return _repair(messages, Counter(), tolerated)


def _repair(
    messages: list[Message], breaks: Counter[Hashable], tolerated: Counter[Hashable]
) -> Validation:
    """The repair pass. Each break is counted in ``breaks`` (by what it is: the result's or
    the call's id, the function's name); one that ``tolerated`` still counts is left as it is."""
    out: list[Message] = []
    repairs: list[str] = []
    # The open block: index of its assistant in the input, its call ids in order (with
    # repetitions), the remaining multiplicity per id, and the legacy function call if any.
    owner = -1
    call_order: list[str] = []
    pending: dict[str, int] = {}
    function_name: str | None = None

    def left_alone(key: Hashable) -> bool:
        breaks[key] += 1
        if tolerated[key] > 0:
            tolerated[key] -= 1
            return True
        return False

    def close_block() -> None:
        nonlocal function_name
        for call_id in call_order:
            left = pending.get(call_id, 0)
            if left:
                pending[call_id] = left - 1
                if left_alone(("call", call_id)):
                    continue
                out.append({"role": "tool", "tool_call_id": call_id, "content": PLACEHOLDER})
                repairs.append(
                    f"inserted a placeholder result for unanswered tool call {call_id!r} "
                    f"of message {owner}"
                )
        call_order.clear()
        pending.clear()
        if function_name is not None:
            if not left_alone(("function_call", function_name)):
                out.append({"role": "function", "name": function_name, "content": PLACEHOLDER})
                repairs.append(
                    f"inserted a placeholder result for unanswered function call "
                    f"{function_name!r} of message {owner}"
                )
            function_name = None

    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            left = pending.get(call_id, 0) if isinstance(call_id, str) else 0
            if left and isinstance(call_id, str):
                pending[call_id] = left - 1
                out.append(message)
            elif left_alone(("tool", call_id if isinstance(call_id, str) else repr(call_id))):
                out.append(message)
            else:
                repairs.append(
                    f"dropped tool result {index} (tool_call_id {call_id!r}): no pending call"
                )
            continue
        if role == "function":
            if function_name is not None:
                function_name = None
                out.append(message)
            elif left_alone(("function",)):
                out.append(message)
            else:
                repairs.append(f"dropped function result {index}: no pending function_call")
            continue

        close_block()
        if role == "assistant":
            fixed = _repair_calls(message, index, [])
            if fixed is message or not left_alone(("calls",)):
                message = _repair_calls(message, index, repairs)
            owner = index
            for call in _calls(fixed):
                call_order.append(call)
                pending[call] = pending.get(call, 0) + 1
            if message.get("function_call") is not None:
                function_name = _function_name(message)
        out.append(message)
    close_block()
    if not repairs:
        return Validation(messages, (), False)
    return Validation(out, tuple(repairs), True)


def _calls(message: Message) -> list[str]:
    """The ids of an assistant message's well-formed calls, in order."""
    calls = message.get("tool_calls")
    return [c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)] \
        if isinstance(calls, list) else []


def _repair_calls(message: Message, index: int, repairs: list[str]) -> Message:
    """The assistant message with a well-formed ``tool_calls`` (a copy only if it changes)."""
    calls: Any = message.get("tool_calls")
    if calls is None:
        return message
    if isinstance(calls, list):
        good = [c for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if good and len(good) == len(calls):
            return message
        if len(good) != len(calls):
            repairs.append(
                f"dropped {len(calls) - len(good)} malformed tool call(s) from message {index}"
            )
    else:
        good = []
        repairs.append(f"removed tool_calls of message {index}: not a list")
    fixed = dict(message)
    if good:
        fixed["tool_calls"] = good
    else:
        del fixed["tool_calls"]
        if isinstance(calls, list) and not calls:
            repairs.append(f"removed empty tool_calls from message {index}")
        if fixed.get("content") is None:
            # The API requires content on an assistant message without tool calls.
            fixed["content"] = ""
    return fixed


class ValidateStage:
    """Runs before every forward: no orphaned result or unanswered call reaches the provider."""

    name = "validate"

    def __call__(self, messages: list[Message], request: RequestView) -> StageOutcome:
        # Only what the proxy's own changes broke is repaired: the client's list is the baseline.
        result = validate(messages, request.messages)
        if result.changed:
            shown = "; ".join(result.repairs[:_SHOWN_REPAIRS])
            more = len(result.repairs) - _SHOWN_REPAIRS
            _log.warning("repaired the message list before forwarding: %s%s", shown,
                         f"; and {more} more" if more > 0 else "")
        repairs = len(result.repairs)
        # A history the client itself starts with an assistant turn is the provider's to judge.
        if request.api == "messages" and not starts_with_user(list(request.messages)).changed:
            bridged = starts_with_user(result.messages)
            if bridged.changed:  # expected after a compaction: not a repair of the client's list
                result = Validation(bridged.messages, result.repairs, True)
        return StageOutcome(result.messages, result.changed, {"repairs": repairs})
