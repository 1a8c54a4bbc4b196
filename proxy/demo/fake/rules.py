"""The providers' request validation, as the strict fake upstream enforces it
(``FakeUpstream(strict=True)``, the default): one pure function per wire format,
:func:`check_chat`, :func:`check_responses` and :func:`check_messages`, each returning the
first :class:`Violation` of a request body or None.

Only rules the providers document (or whose 400 is well attested with its own message) are
here; a rule with a comment "fake's wording" has a documented condition but no known message
text, so the message mirrors the provider's style. Where the docs are silent nothing is
refused: a shape the fake does not know passes.

Model-specific rules read :class:`ModelRules`, the fake's own table (a module constant, each
entry citing its source; a test overrides it per fake). A model the table does not name (a
test's made-up ``fake-model``) gets the permissive defaults: sampling parameters accepted,
chat completions served, temperature free; and no mid-conversation system messages, since the
Messages API refuses ``role: "system"`` on every model but the few listed (the conservative
reading: a request only an unreleased model would take is one the proxy must not forward).
The structural rules (roles, tool pairing, cache breakpoints...) apply to every model.

Sources (platform.claude.com / platform.openai.com as stored by the search tool):

* Messages API reference, https://platform.claude.com/docs/en/api/messages (``model``,
  ``max_tokens`` and ``messages`` required; roles; consecutive same-role turns are combined).
* "Mid-conversation system messages",
  https://platform.claude.com/docs/en/build-with-claude/mid-conversation-system-messages and
  https://platform.claude.com/docs/en/about-claude/models/whats-new-claude-4-8 (Opus 4.8
  introduced them; placement and content rules; unsupported models answer 400).
* "Handle tool calls" / "How tool use works",
  https://platform.claude.com/docs/en/agents-and-tools/tool-use/handle-tool-calls (tool_result
  blocks immediately after their tool_use, first in the user message's content).
* "Prompt caching", https://platform.claude.com/docs/en/build-with-claude/prompt-caching (at
  most 4 cache breakpoints).
* "What's new in Claude Opus 4.7" (sampling parameters at non-default values are a 400 on Opus
  4.7 and later models) and "API versions" (``anthropic-version: 2026-10-21`` refuses
  ``temperature``, ``top_p`` and ``top_k`` at any value, ``document`` blocks in assistant
  messages and citations on user text blocks),
  https://platform.claude.com/docs/en/api/versioning.
* OpenAI chat completions reference, https://platform.openai.com/docs/api-reference/chat, and
  the "Reasoning models" guide (only the default temperature on o-series and GPT-5 models);
  the Responses reference, https://platform.openai.com/docs/api-reference/responses, and the
  "Function calling" guide (a ``function_call_output`` answers a call by its ``call_id``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "DEFAULT_MODEL_RULES",
    "MID_CONVERSATION_SYSTEM",
    "NO_SAMPLING_PARAMS",
    "OPENAI_DEFAULT_TEMPERATURE_ONLY",
    "RESPONSES_ONLY",
    "ModelRules",
    "Violation",
    "check_chat",
    "check_messages",
    "check_responses",
    "model_key",
]


@dataclass(frozen=True, slots=True)
class Violation:
    """The first rule a request breaks: ``rule`` names it (``"<format>.<rule>"``),
    ``message`` is what the provider says; ``param`` / ``code`` fill OpenAI's envelope;
    ``status`` the HTTP status the provider answers with."""

    rule: str
    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400


# --- the model table ----------------------------------------------------------------------

#: Claude models taking ``role: "system"`` inside ``messages``. The docs: "Claude Opus 4.8
#: accepts role: "system" messages immediately after a user turn" (whats-new-claude-4-8);
#: litellm's bundled map (``supports_mid_conversation_system: true``) adds the later models.
MID_CONVERSATION_SYSTEM: Final = (
    "claude-opus-4-8", "claude-opus-5", "claude-opus-5-5", "claude-sonnet-5",
    "claude-sonnet-5-5", "claude-haiku-5-5", "claude-fable-5", "claude-fable-5-1",
    "claude-mythos-5", "claude-mythos-5-1",
)
#: Claude models refusing non-default ``temperature`` / ``top_p`` / ``top_k`` on every
#: request: Anthropic's list (whats-new-claude-4-7, "Sampling parameters"; litellm's map:
#: ``supports_sampling_params: false``): Opus 4.7 and every later model.
NO_SAMPLING_PARAMS: Final = (
    "claude-opus-4-7", "claude-opus-4-8", "claude-opus-5", "claude-opus-5-5",
    "claude-sonnet-5", "claude-sonnet-5-5", "claude-haiku-5-5", "claude-fable-5",
    "claude-fable-5-1", "claude-mythos-5", "claude-mythos-5-1", "claude-mythos-preview",
)
#: OpenAI reasoning models: only the default temperature (OpenAI's "Reasoning models" guide;
#: GPT-5.1 and later take others with ``reasoning_effort: "none"``), globs on the bare name.
OPENAI_DEFAULT_TEMPERATURE_ONLY: Final = ("o1*", "o3*", "o4*", "gpt-5*")
#: ... except GPT-5's non-reasoning chat models.
OPENAI_TEMPERATURE_EXEMPT: Final = ("gpt-5*-chat*",)
#: Models OpenAI serves on ``/v1/responses`` only (litellm's map: ``mode: responses`` /
#: ``supported_endpoints`` without chat completions): the ``-codex`` models, the ``-pro`` and
#: deep-research ones, computer use.
RESPONSES_ONLY: Final = (
    "*codex*", "gpt-5-pro*", "gpt-5.*-pro*", "o1-pro*", "o3-pro*", "o3-deep-research*",
    "o4-mini-deep-research*", "computer-use-preview*",
)

_DATE_SUFFIX = re.compile(r"(-\d{8}|-\d{4}-\d{2}-\d{2})$")
_BEDROCK_VERSION = re.compile(r"-v\d+(:\d+)?$")


def model_key(model: str) -> str:
    """A model name as the tables name it: lower-cased, without provider prefix
    (``anthropic/``, ``us.anthropic.``), Vertex ``@`` suffix, Bedrock ``-v1:0`` or date."""
    name = model.strip().lower().rsplit("/", 1)[-1].split("@", 1)[0]
    if "anthropic." in name:
        name = name.split("anthropic.", 1)[1]
    name = _BEDROCK_VERSION.sub("", name)
    return _DATE_SUFFIX.sub("", name)


def _matches(model: Any, patterns: Sequence[str]) -> bool:
    if not isinstance(model, str) or not model:
        return False
    key = model_key(model)
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


@dataclass(frozen=True, slots=True)
class ModelRules:
    """The fake's per-model facts, as globs matched against :func:`model_key`; replace a
    field (``dataclasses.replace(DEFAULT_MODEL_RULES, mid_conversation_system=("m",))``) to
    give a made-up model a real model's rules."""

    mid_conversation_system: tuple[str, ...] = MID_CONVERSATION_SYSTEM
    no_sampling_params: tuple[str, ...] = NO_SAMPLING_PARAMS
    default_temperature_only: tuple[str, ...] = OPENAI_DEFAULT_TEMPERATURE_ONLY
    temperature_exempt: tuple[str, ...] = OPENAI_TEMPERATURE_EXEMPT
    responses_only: tuple[str, ...] = RESPONSES_ONLY

    def supports_mid_conversation_system(self, model: Any) -> bool:
        return _matches(model, self.mid_conversation_system)

    def refuses_sampling_params(self, model: Any) -> bool:
        return _matches(model, self.no_sampling_params)

    def default_temperature(self, model: Any) -> bool:
        """Whether ``model`` takes only ``temperature: 1`` (an OpenAI reasoning model)."""
        return _matches(model, self.default_temperature_only) and not _matches(
            model, self.temperature_exempt)

    def responses_only_model(self, model: Any) -> bool:
        return _matches(model, self.responses_only)


DEFAULT_MODEL_RULES: Final = ModelRules()


# --- shared helpers -------------------------------------------------------------------------


def _number_text(value: Any) -> str:
    """A JSON number as OpenAI quotes it back (``0``, ``0.0``, ``0.2``)."""
    return repr(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _openai_temperature(body: Mapping[str, Any], rules: ModelRules,
                        effort: Any, fmt: str) -> Violation | None:
    """o-series and GPT-5 models: any temperature but 1 is refused ("Reasoning models":
    "temperature ... only the default (1) value is supported"); GPT-5.1+ accept others with
    reasoning effort ``none`` (GPT-5.1 / 5.2 guides), taken as any model given ``none``."""
    temperature = body.get("temperature")
    if (not _is_number(temperature) or temperature == 1 or effort == "none"
            or not rules.default_temperature(body.get("model"))):
        return None
    return Violation(
        f"{fmt}.temperature",
        f"Unsupported value: 'temperature' does not support {_number_text(temperature)} with "
        "this model. Only the default (1) value is supported.",
        param="temperature", code="unsupported_value")


def _missing_model(body: Mapping[str, Any], fmt: str) -> Violation | None:
    # OpenAI: a request without a model is a 400 "you must provide a model parameter".
    if isinstance(body.get("model"), str) and body["model"]:
        return None
    return Violation(f"{fmt}.model", "you must provide a model parameter")


# --- OpenAI chat completions ---------------------------------------------------------------

_CHAT_ROLES: Final = ("system", "assistant", "user", "function", "tool", "developer")


def _chat_roles_text() -> str:
    quoted = [f"'{r}'" for r in _CHAT_ROLES]
    return ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def check_chat(body: Mapping[str, Any],
               rules: ModelRules = DEFAULT_MODEL_RULES) -> Violation | None:
    """The first rule of OpenAI's chat completions API ``body`` breaks, or None.

    * ``model`` required; a Responses-only model (the ``-codex`` ones...) is answered 404
      "This model is only supported in v1/responses and not in v1/chat/completions."
      (litellm's map, ``supported_endpoints``; the message and status as OpenAI sends them);
    * ``messages`` a non-empty array ("Invalid 'messages': empty array...");
    * each role one of system/developer/user/assistant/tool/function;
    * ``tool_calls`` on an assistant message non-empty (``empty_array``);
    * a ``tool`` message answers an id of the assistant ``tool_calls`` message it follows
      (only tool messages between): "Invalid parameter: messages with role 'tool' must be a
      response to a preceeding message with 'tool_calls'." (sic: OpenAI's spelling);
    * every id of an assistant ``tool_calls`` message answered before the next non-tool
      message (or the end): "An assistant message with 'tool_calls' must be followed by tool
      messages responding to each 'tool_call_id'. ...";
    * ``temperature`` only 1 on reasoning models (:func:`_openai_temperature`).
    """
    found = _missing_model(body, "chat")
    if found is not None:
        return found
    if rules.responses_only_model(body["model"]):
        return Violation(
            "chat.responses_only_model",
            "This model is only supported in v1/responses and not in v1/chat/completions.",
            param="model", status=404)
    messages = body.get("messages")
    if messages is None:
        return Violation("chat.messages", "Missing required parameter: 'messages'.",
                         param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        return Violation("chat.messages",
                         "Invalid type for 'messages': expected an array, but got "
                         f"{_json_kind(messages)} instead.",
                         param="messages", code="invalid_type")
    if not messages:
        return Violation("chat.messages",
                         "Invalid 'messages': empty array. Expected an array with minimum "
                         "length 1, but got an empty array instead.",
                         param="messages", code="empty_array")
    found = _chat_messages(messages)
    if found is not None:
        return found
    return _openai_temperature(body, rules, body.get("reasoning_effort"), "chat")


def _chat_messages(messages: list[Any]) -> Violation | None:
    open_at: int | None = None  # the assistant tool_calls message the tool run answers
    ids: list[str] = []
    pending: list[str] = []

    def unanswered() -> Violation:
        return Violation(
            "chat.tool_calls_answered",
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            f"response messages: {', '.join(pending)}",
            param=f"messages.[{open_at}].role")

    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return Violation("chat.message_type",
                             f"Invalid type for 'messages[{i}]': expected an object, but got "
                             f"{_json_kind(m)} instead.",
                             param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            return Violation("chat.role",
                             f"Invalid value: '{role}'. Supported values are: "
                             f"{_chat_roles_text()}.",
                             param=f"messages[{i}].role", code="invalid_value")
        if role == "tool":
            if open_at is None:
                return Violation(
                    "chat.tool_follows_tool_calls",
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'.",
                    param=f"messages.[{i}].role")
            call_id = m.get("tool_call_id")
            if call_id is None:
                return Violation("chat.tool_call_id",
                                 f"Missing required parameter: 'messages[{i}].tool_call_id'.",
                                 param=f"messages[{i}].tool_call_id",
                                 code="missing_required_parameter")
            if call_id not in ids:
                return Violation(
                    "chat.tool_call_id",
                    f"Invalid parameter: 'tool_call_id' of '{call_id}' not found in "
                    "'tool_calls' of previous message.",
                    param=f"messages.[{i}].tool_call_id")
            if call_id in pending:
                pending.remove(call_id)
            continue
        if pending:
            return unanswered()
        open_at, ids = None, []
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            if not isinstance(calls, list):
                continue  # a type error the fake does not model
            if not calls:
                return Violation(
                    "chat.tool_calls_empty",
                    f"Invalid 'messages[{i}].tool_calls': empty array. Expected an array "
                    "with minimum length 1, but got an empty array instead.",
                    param=f"messages[{i}].tool_calls", code="empty_array")
            ids = [str(c.get("id")) for c in calls if isinstance(c, dict)]
            pending = list(ids)
            open_at = i
    if pending:
        return unanswered()
    return None


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "null"
    return "an object"


# --- OpenAI Responses ----------------------------------------------------------------------

#: output item types that answer a call by ``call_id``, and what the 400 calls them
_CALL_OUTPUTS: Final = {
    "function_call_output": "function call output",
    "custom_tool_call_output": "custom tool call output",  # fake's wording
}


def check_responses(body: Mapping[str, Any],
                    rules: ModelRules = DEFAULT_MODEL_RULES) -> Violation | None:
    """The first rule of OpenAI's Responses API ``body`` breaks, or None.

    * ``model`` required;
    * ``input``, when given, a string or an array ("Invalid type for 'input'...");
    * a ``function_call_output`` / ``custom_tool_call_output`` answers a call (any
      ``*_call`` item with that ``call_id``) earlier in ``input``: "No tool call found for
      function call output with call_id ..." (param ``input``) -- unless the conversation
      lives upstream (``previous_response_id``, ``conversation``) or an ``item_reference``
      may name the call;
    * ``temperature`` only 1 on reasoning models, unless ``reasoning.effort`` is ``none``.
    """
    found = _missing_model(body, "responses")
    if found is not None:
        return found
    items = body.get("input")
    if items is not None and not isinstance(items, str | list):
        return Violation("responses.input",
                         "Invalid type for 'input': expected one of a string or array of "
                         f"input items, but got {_json_kind(items)} instead.",
                         param="input", code="invalid_type")
    upstream = bool(body.get("previous_response_id")) or bool(body.get("conversation"))
    if isinstance(items, list) and not upstream:
        found = _responses_calls(items)
        if found is not None:
            return found
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return _openai_temperature(body, rules, effort, "responses")


def _responses_calls(items: list[Any]) -> Violation | None:
    if any(isinstance(it, dict) and it.get("type") == "item_reference" for it in items):
        return None  # the referenced items may hold the calls
    seen: set[str] = set()
    for it in items:
        if not isinstance(it, dict):
            continue
        kind = it.get("type")
        call_id = it.get("call_id")
        if isinstance(kind, str) and kind in _CALL_OUTPUTS:
            if call_id not in seen:
                return Violation(
                    "responses.call_output_matches_call",
                    f"No tool call found for {_CALL_OUTPUTS[kind]} with call_id {call_id}.",
                    param="input")
        elif isinstance(kind, str) and kind.endswith("_call") and isinstance(call_id, str):
            seen.add(call_id)
    return None


# --- Anthropic Messages --------------------------------------------------------------------

#: the API version from which sampling parameters are refused at any value ("API versions")
SAMPLING_REMOVED_VERSION: Final = "2026-10-21"
#: block types Claude produces (assistant turns only: "How tool use works", "Extended
#: thinking": tool_use and thinking blocks are the assistant's)
_ASSISTANT_ONLY: Final = frozenset({"tool_use", "thinking", "redacted_thinking"})
#: block types only the user sends ("Handle tool calls": tool results go in a user message)
_USER_ONLY: Final = frozenset({"tool_result"})
_SAMPLING: Final = ("temperature", "top_p", "top_k")


@dataclass(frozen=True, slots=True)
class _Turn:
    """Consecutive messages of one role, as the API combines them ("Consecutive user or
    assistant turns in your request will be combined into a single turn"); a system message
    is a turn of its own."""

    role: str
    first: int  # index of its first message
    #: (message index, block index, block) of every block, in order
    blocks: list[tuple[int, int, dict[str, Any]]]


def _blocks_of(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return []


def _turns(messages: list[dict[str, Any]]) -> list[_Turn]:
    turns: list[_Turn] = []
    for i, m in enumerate(messages):
        role = m["role"]
        blocks = [(i, j, b) for j, b in enumerate(_blocks_of(m.get("content")))]
        if turns and role != "system" and turns[-1].role == role:
            turns[-1].blocks.extend(blocks)
        else:
            turns.append(_Turn(role, i, blocks))
    return turns


def check_messages(body: Mapping[str, Any], rules: ModelRules = DEFAULT_MODEL_RULES, *,
                   api_version: str | None = None) -> Violation | None:
    """The first rule of Anthropic's Messages API ``body`` breaks, or None; ``api_version``
    is the request's ``anthropic-version`` header.

    In order: the required fields (Messages API reference); roles and mid-conversation
    system messages; the first message; content (non-empty, text blocks non-empty, block
    types per role); tool_use / tool_result pairing; at most 4 cache breakpoints; sampling
    parameters per model and API version; the 2026-10-21 content rules.
    """
    model = body.get("model")
    if model is None:
        return Violation("messages.model", "model: Field required")
    if not isinstance(model, str):
        return Violation("messages.model", "model: Input should be a valid string")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        return Violation("messages.max_tokens", "max_tokens: Field required")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        return Violation("messages.max_tokens", "max_tokens: Input should be a valid integer")
    if max_tokens < 1:
        return Violation("messages.max_tokens",
                         "max_tokens: Input should be greater than or equal to 1")
    messages = body.get("messages")
    if messages is None:
        return Violation("messages.messages", "messages: Field required")
    if not isinstance(messages, list):
        return Violation("messages.messages", "messages: Input should be a valid list")
    if not messages:
        return Violation("messages.messages", "messages: at least one message is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return Violation("messages.messages",
                             f"messages.{i}: Input should be a valid dictionary")
        if m.get("role") not in ("user", "assistant", "system"):
            return Violation("messages.role",
                             f"messages.{i}.role: Input should be 'user' or 'assistant'")
    for check in (_system_messages, _first_message, _content, _tool_pairing):
        found = check(messages, model, rules)
        if found is not None:
            return found
    found = _cache_breakpoints(body, messages)
    if found is not None:
        return found
    return _sampling(body, messages, model, rules, api_version)


def _system_messages(messages: list[dict[str, Any]], model: str,
                     rules: ModelRules) -> Violation | None:
    """``role: "system"`` inside ``messages`` ("Mid-conversation system messages"): only on
    the models that support it ("Requests that include role: "system" in messages[] on
    unsupported models return a 400 invalid_request_error"); never first; right after a user
    message or an assistant message ending in a server tool use; last, or followed by an
    assistant turn (so never two in a row); text content only."""
    indices = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if not indices:
        return None
    if not rules.supports_mid_conversation_system(model):
        return Violation("messages.system_role_unsupported",
                         "role 'system' is not supported on this model")
    for i in indices:
        if i == 0:
            continue  # the first-message rule says it
        before = messages[i - 1]
        blocks = _blocks_of(before.get("content"))
        after_server_tool = (before["role"] == "assistant" and bool(blocks)
                             and blocks[-1].get("type") == "server_tool_use")
        if before["role"] != "user" and not after_server_tool:
            # fake's wording (the documented rule; the API's text for it is not known)
            return Violation("messages.system_placement",
                             f"messages.{i}: role 'system' must follow a 'user' message or an "
                             "'assistant' message ending in a server tool use")
        if i + 1 < len(messages) and messages[i + 1]["role"] != "assistant":
            return Violation("messages.system_placement",
                             f"messages.{i}: role 'system' must precede an 'assistant' message "
                             "or end the array")
        content = messages[i].get("content")
        if isinstance(content, list):
            for j, b in enumerate(content):
                if not isinstance(b, dict) or b.get("type") != "text":
                    # fake's wording ("System-role message content supports text blocks only")
                    return Violation("messages.system_content",
                                     f"messages.{i}.content.{j}: role 'system' messages "
                                     "support text blocks only")
    return None


def _first_message(messages: list[dict[str, Any]], model: str,
                   rules: ModelRules) -> Violation | None:
    """The first message has the user role (the API's 400: ``messages: first message must
    use the "user" role``; a mid-conversation system message "Cannot be the first entry")."""
    if messages[0]["role"] != "user":
        return Violation("messages.first_role",
                         'messages: first message must use the "user" role')
    return None


def _content(messages: list[dict[str, Any]], model: str,
             rules: ModelRules) -> Violation | None:
    """Every message has content but an optional final assistant one (prefill); text blocks
    are neither empty nor whitespace only (the API's 400s "text content blocks must be
    non-empty" / "must contain non-whitespace text"); tool results are the user's, tool_use
    and thinking blocks the assistant's ("How tool use works", "Extended thinking")."""
    last = len(messages) - 1
    for i, m in enumerate(messages):
        content = m.get("content")
        if content in ("", []) and not (i == last and m["role"] == "assistant"):
            return Violation("messages.content_non_empty",
                             f"messages.{i}: all messages must have non-empty content except "
                             "for the optional final assistant message")
        if not isinstance(content, list):
            continue
        for j, b in enumerate(content):
            if not isinstance(b, dict):
                continue
            kind = b.get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                if not b["text"]:
                    return Violation("messages.text_non_empty",
                                     "messages: text content blocks must be non-empty")
                if not b["text"].strip():
                    return Violation("messages.text_non_empty",
                                     "messages: text content blocks must contain "
                                     "non-whitespace text")
            if kind in _USER_ONLY and m["role"] != "user":
                return Violation("messages.block_role",  # fake's wording
                                 f"messages.{i}.content.{j}: `{kind}` blocks can only be in "
                                 "`user` messages")
            if kind in _ASSISTANT_ONLY and m["role"] != "assistant":
                return Violation("messages.block_role",  # fake's wording
                                 f"messages.{i}.content.{j}: `{kind}` blocks can only be in "
                                 "`assistant` messages")
    return None


def _tool_pairing(messages: list[dict[str, Any]], model: str,
                  rules: ModelRules) -> Violation | None:
    """"Handle tool calls": each tool_use of an assistant turn is answered by a tool_result
    in the user turn right after it, and those results come first in its content; a
    tool_result answers a tool_use of the assistant turn right before it. The API's 400s:
    "`tool_use` ids were found without `tool_result` blocks immediately after: ...",
    "Did not find N `tool_result` block(s) at the beginning of this message...",
    "unexpected `tool_use_id` found in `tool_result` blocks: ..."."""
    turns = _turns(messages)
    asks = [_tool_use_ids(t) if t.role == "assistant" else [] for t in turns]
    for k, turn in enumerate(turns):
        if turn.role == "user":
            asked = set(asks[k - 1]) if k else set()
            for i, j, b in turn.blocks:
                if b.get("type") == "tool_result" and b.get("tool_use_id") not in asked:
                    return Violation(
                        "messages.tool_result_matches_tool_use",
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {b.get('tool_use_id')}. Each `tool_result` "
                        "block must have a corresponding `tool_use` block in the previous "
                        "message.")
        ids = asks[k]
        if not ids:
            continue
        after = turns[k + 1] if k + 1 < len(turns) else None
        answered: set[Any] = set()
        leading = 0
        if after is not None and after.role == "user":
            results = [b for _, _, b in after.blocks]
            answered = {b.get("tool_use_id") for b in results if b.get("type") == "tool_result"}
            for b in results:
                if b.get("type") != "tool_result":
                    break
                leading += 1
        missing = [t for t in ids if t not in answered]
        if missing:
            at = next(i for i, _, b in turn.blocks
                      if b.get("type") == "tool_use" and b.get("id") == missing[0])
            return Violation(
                "messages.tool_use_answered",
                f"messages.{at}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(map(str, missing))}. Each `tool_use` block "
                "must have a corresponding `tool_result` block in the next message.")
        if leading < len(ids):
            assert after is not None
            return Violation(
                "messages.tool_results_first",
                f"messages.{after.first}: Did not find {len(ids)} `tool_result` block(s) at "
                "the beginning of this message. Messages following `tool_use` blocks must "
                "begin with a matching number of `tool_result` blocks.")
    return None


def _tool_use_ids(turn: _Turn) -> list[Any]:
    return [b.get("id") for _, _, b in turn.blocks if b.get("type") == "tool_use"]


def _markers(body: Mapping[str, Any], messages: list[dict[str, Any]]) -> Iterator[Any]:
    """The cache breakpoints of a request: on tools, system blocks, messages (a system-role
    message's own) and their content blocks, and the top-level one (automatic caching)."""
    if body.get("cache_control") is not None:
        yield body["cache_control"]
    for holder in (body.get("tools"), body.get("system")):
        if isinstance(holder, list):
            yield from (b["cache_control"] for b in holder
                        if isinstance(b, dict) and b.get("cache_control") is not None)
    for m in messages:
        if m.get("cache_control") is not None:
            yield m["cache_control"]
        content = m.get("content")
        if isinstance(content, list):
            yield from (b["cache_control"] for b in content
                        if isinstance(b, dict) and b.get("cache_control") is not None)


def _cache_breakpoints(body: Mapping[str, Any],
                       messages: list[dict[str, Any]]) -> Violation | None:
    """"Prompt caching": "You can define up to 4 cache breakpoints"; the API's 400: "A
    maximum of 4 blocks with cache_control may be provided. Found N."."""
    found = sum(1 for _ in _markers(body, messages))
    if found > 4:
        return Violation("messages.cache_breakpoints",
                         "A maximum of 4 blocks with cache_control may be provided. "
                         f"Found {found}.")
    return None


def _sampling(body: Mapping[str, Any], messages: list[dict[str, Any]], model: str,
              rules: ModelRules, api_version: str | None) -> Violation | None:
    """From ``anthropic-version: 2026-10-21`` ("API versions"): ``temperature``, ``top_p``
    and ``top_k`` are refused at any value ("temperature: Extra inputs are not permitted"),
    as are ``document`` blocks in assistant messages and citations on user text blocks.
    Before it, Opus 4.7 and later refuse them at non-default values ("`temperature` is
    deprecated for this model."): temperature other than 1; top_p and top_k, whose defaults
    the docs do not give, at any value."""
    if api_version is not None and api_version >= SAMPLING_REMOVED_VERSION:
        for name in _SAMPLING:
            if name in body:
                return Violation("messages.sampling_version",
                                 f"{name}: Extra inputs are not permitted")
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, list):
                continue
            for j, b in enumerate(content):
                if not isinstance(b, dict):
                    continue
                if m["role"] == "assistant" and b.get("type") == "document":
                    return Violation("messages.version_content",  # fake's wording
                                     f"messages.{i}.content.{j}: `document` blocks are not "
                                     "supported in `assistant` messages")
                if m["role"] == "user" and b.get("type") == "text" and b.get("citations"):
                    return Violation("messages.version_content",  # fake's wording
                                     f"messages.{i}.content.{j}.citations: citations are not "
                                     "supported on `text` blocks in `user` messages")
        return None
    if not rules.refuses_sampling_params(model):
        return None
    for name in _SAMPLING:
        value = body.get(name)
        if value is None or (name == "temperature" and value == 1):
            continue
        return Violation("messages.sampling_model", f"`{name}` is deprecated for this model.")
    return None
