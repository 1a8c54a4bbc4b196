"""Model-in-the-loop fidelity probes: ask a real model about a session with its full history and
with what ctxproxy forwarded, and score both answers (issue 20).

Factory.ai-style probes (their "evaluating context compression" method) are generated from a
checkpoint's canaries -- facts planted in a synthetic session -- one question per kind:

* ``recall``: "what was the exact error message, and its fix?";
* ``artifact``: "which files did you create, modify or delete?" (one probe for all the paths);
* ``continuation``: "what is the next step?";
* ``decision``: "why did we choose X?";
* any other kind (a goal, a constraint): "what was <subject>? quote it exactly".

Each probe is asked twice of an OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp's
server, a provider): after the client's full history and after the history ctxproxy forwarded
(a chat, Responses or Messages body, read into chat messages by the project's own format readers,
:mod:`proxy.formats`). Answers are scored by a deterministic rubric (:func:`rubric`: every
expected string present -> 1, key tokens partly present -> 0.5, else 0) and, optionally, by the
same endpoint as judge (a 0-5 grade, :func:`parse_grade`).

    client = ChatClient("http://127.0.0.1:8000/v1", "Qwen/Qwen3-8B")
    async with client:
        result = await run_checkpoint(client, checkpoint, judge=True)
    print(format_table([result]))

A checkpoint is anything with ``format``, ``turn``, ``full_body`` or ``full_messages`` (what the
client sent, in its wire format: the whole body, or a bare history -- chat messages, Responses
input items, Anthropic messages), ``forwarded_body`` (the body ctxproxy sent upstream, a dict or bytes) and ``canaries``
(:class:`Canary`, or objects or dicts with a kind and a text; see :func:`as_canary`):
:mod:`harness.fidelity`'s ``Checkpoint`` is one, :class:`Checkpoint` here another.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType, TracebackType
from typing import Any, Final, Literal, Protocol, Self

import aiohttp
import orjson

from proxy.formats import Format
from proxy.formats.chat.request import CHAT
from proxy.formats.messages.request import MESSAGES
from proxy.formats.responses.request import RESPONSES
from proxy.model import Message
from proxy.tokens.counter import TokenCounter

__all__ = [
    "Answer",
    "Canary",
    "ChatClient",
    "Checkpoint",
    "CheckpointLike",
    "CheckpointResult",
    "Completion",
    "Probe",
    "ProbeResult",
    "as_canary",
    "ask",
    "chat_messages",
    "format_table",
    "grade",
    "histories",
    "judge_prompt",
    "key_tokens",
    "parse_grade",
    "probes_for",
    "rubric",
    "run_checkpoint",
]

log = logging.getLogger("harness.probes")

Style = Literal["text", "native"]
Condition = Literal["full", "slimmed"]

FORMATS: Final[Mapping[str, Format]] = MappingProxyType(
    {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES})
# Where each format keeps its conversation in a body.
_HISTORY_FIELD: Final = MappingProxyType(
    {"chat": "messages", "responses": "input", "messages": "messages"})

# Canary kinds as the fidelity harness (proxy.testing.fidelity.KINDS) or a person may name them
# -> the probe that asks about them. Kinds not here get a probe of their own kind.
_KIND_ALIASES: Final = MappingProxyType({
    "recall": "recall", "error": "recall", "fix": "recall",
    "artifact": "artifact", "file": "artifact", "files": "artifact",
    "deleted_file": "artifact", "edited_file": "artifact", "created_file": "artifact",
    "continuation": "continuation", "next": "continuation", "next_step": "continuation",
    "plan": "continuation", "todo": "continuation",
    "decision": "decision", "why": "decision", "rationale": "decision",
})
# One question per probe kind; every canary of the kind is expected in its answer (a decision
# is asked about one at a time: "why did we choose X?" needs its X).
_QUESTIONS: Final = MappingProxyType({
    "recall": "What were the exact error messages we ran into, and how did we fix them?",
    "artifact": "Which files did you create, modify or delete in this session? List their paths.",
    "continuation": "What are the next steps we planned and have not done yet? Be specific.",
    "goal": "What is the goal of this session? State it as the user did.",
    "constraint": "What hard rules or constraints did the user set? Quote them exactly.",
    "preference": "What preferences did the user state about how to work? Quote them exactly.",
    "request": "What did the user ask for besides the main goal? Quote it exactly.",
    "path": "Which file paths came up as important? Give them exactly.",
    "identifier": "Which function, class or constant names came up as important? Give them exactly.",
    "number": "Which measured figures (latencies, counts, sizes) came up? Give them exactly.",
})
_SIZE_MODEL: Final = "gpt-4o"  # whose tokenizer sizes the histories in the results
_ORDER: Final = ("recall", "artifact", "continuation", "decision")
_ANSWER_HINT: Final = ("Answer from the conversation above only, briefly; quote names, paths and "
                       "messages exactly as they appeared.")
# Words that never make a key token: they would let any fluent answer score partially.
_STOPWORDS: Final = frozenset(
    "the and for with that this from was were are has have had not but you our use used into "
    "because when then than them they its also will would should can could did does done".split())
_TOKEN: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/'-]*[A-Za-z0-9_]")
_GRADE_PATTERNS: Final = (
    re.compile(r"grade\s*[:=]?\s*\**\s*([0-5](?:\.\d+)?)\b", re.I),
    re.compile(r"\b([0-5](?:\.\d+)?)\**\s*(?:/|out of)\s*5\b", re.I),
    re.compile(r"(?:score|rating)\s*[:=]?\s*\**\s*([0-5](?:\.\d+)?)\b", re.I),
    re.compile(r"^\s*\**([0-5](?:\.\d+)?)\**\s*$", re.M),
)


# --- canaries and probes -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Canary:
    """A fact planted in a session. ``text``: the exact string an answer must contain;
    ``pattern``: a regex that counts as containing it too (a deleted file's path next to
    "deleted" when ``text`` is the ``rm`` command); ``subject``: what it is about (the X of "why
    did we choose X?"); ``tokens``: its key tokens for partial credit (derived from ``text``
    when empty); ``extra``: further strings the same probe expects (a recall canary's fix)."""

    kind: str
    text: str
    subject: str = ""
    tokens: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    pattern: str = ""


def as_canary(value: Any) -> Canary:
    """A :class:`Canary` from one, a mapping or an object (the fidelity harness's), reading the
    first present of the usual names (``kind``/``type``, ``text``/``value``/``string``/
    ``canary``/``expected``, ``subject``/``about``/``label``, ``tokens``/``key_tokens``,
    ``extra``/``fix``, ``pattern``)."""
    if isinstance(value, Canary):
        return value

    def get(*names: str) -> Any:
        for name in names:
            found = value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)
            if found is not None:
                return found
        return None

    kind = get("kind", "type", "category")
    text = get("text", "value", "string", "canary", "expected")
    if not isinstance(text, str) or not text:
        raise ValueError(f"a canary needs a text: {value!r}")
    tokens = get("tokens", "key_tokens")
    extra = get("extra", "fix")
    pattern = get("pattern")
    return Canary(
        kind=str(getattr(kind, "value", kind) or "recall"), text=text,
        subject=str(get("subject", "about", "label") or ""),
        tokens=tuple(str(t) for t in tokens) if isinstance(tokens, list | tuple) else (),
        extra=(extra,) if isinstance(extra, str) else tuple(str(e) for e in extra or ()),
        pattern=pattern if isinstance(pattern, str) else "")


@dataclass(frozen=True, slots=True)
class Probe:
    """One question and what a faithful answer contains."""

    kind: str  # recall | artifact | continuation | decision | the canaries' own kind
    question: str
    expected: tuple[str, ...]  # every one present -> full marks
    tokens: tuple[str, ...]  # key tokens for partial credit
    reference: str  # the reference answer shown to a judge
    # Per expected string, a regex that counts as it ("": none).
    patterns: tuple[str, ...] = ()


def key_tokens(text: str) -> tuple[str, ...]:
    """The distinctive words of ``text`` (identifiers, numbers, paths; no stopwords), in order,
    each once."""
    seen: dict[str, None] = {}
    for token in _TOKEN.findall(text):
        low = token.lower()
        if len(low) >= 3 and low not in _STOPWORDS:
            seen.setdefault(low, None)
    return tuple(seen)


def _probe(kind: str, question: str, canaries: Sequence[Canary],
           expected: Sequence[tuple[str, str]] | None = None) -> Probe:
    """A probe expecting every canary's text (and extra strings), or ``expected`` (string,
    pattern) pairs instead; key tokens per canary: its own, else derived from what it expects."""

    def texts(c: Canary) -> list[str]:
        return [e for e, _ in expected] if expected is not None else [c.text, *c.extra]

    pairs = list(expected) if expected is not None else [
        pair for c in canaries for pair in ((c.text, c.pattern), *((e, "") for e in c.extra))]
    tokens = tuple(dict.fromkeys(
        t for c in canaries for t in (c.tokens or key_tokens(" ".join(texts(c))))))
    reference = "; ".join(f"{c.text}{f' ({c.subject})' if c.subject else ''}"
                          f"{''.join(f'; {e}' for e in c.extra)}" for c in canaries)
    return Probe(kind, f"{question} {_ANSWER_HINT}", tuple(e for e, _ in pairs), tokens,
                 reference, tuple(p for _, p in pairs))


def probes_for(canaries: Sequence[Any]) -> list[Probe]:
    """The probes a checkpoint's canaries call for: one per probe kind (recall: the errors and
    their fixes; artifact: the files; continuation: the open steps; any other kind its own),
    every canary of the kind expected in its answer; one per decision."""
    groups: dict[str, list[Canary]] = {}
    for canary in map(as_canary, canaries):
        kind = _KIND_ALIASES.get(canary.kind.lower(), canary.kind.lower())
        groups.setdefault(kind, []).append(canary)
    out: list[Probe] = []
    for kind in sorted(groups, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER))):
        group = groups[kind]
        if kind == "decision":
            for c in group:
                # "keep X, because Y": asked why X, answered by Y.
                choice, because, reason = c.text.partition(" because ")
                subject = c.subject or (choice.rstrip(" ,") if because else "that approach")
                expected = [(reason, "")] if because and not c.subject else None
                out.append(_probe(kind, f"Why did we choose to {subject}?"
                                  if not c.subject and because else
                                  f"Why did we choose {subject}?", [c], expected))
        elif len(group) == 1 and group[0].subject and kind not in _QUESTIONS:
            out.append(_probe(kind, f"What was {group[0].subject}? Quote it exactly.", group))
        else:
            question = _QUESTIONS.get(kind, f"What {kind.replace('_', ' ')} came up in this "
                                            "session? Quote it exactly.")
            out.append(_probe(kind, question, group))
    return out


# --- scoring -----------------------------------------------------------------------------------


def _normal(text: str) -> str:
    # Case and runs of whitespace don't make an answer wrong; a model rewraps and recapitalises.
    return " ".join(text.lower().split())


def rubric(probe: Probe, answer: str | None) -> float:
    """1 when the answer contains every expected string (case and whitespace aside, or matching
    its pattern); 0.5 when it has one of them, or at least half of the probe's key tokens;
    else 0."""
    if not answer:
        return 0.0
    said = _normal(answer)
    patterns = probe.patterns or ("",) * len(probe.expected)
    present = [_normal(e) in said or bool(p and re.search(p, answer, re.I))
               for e, p in zip(probe.expected, patterns, strict=True)]
    if present and all(present):
        return 1.0
    if any(present):
        return 0.5
    if probe.tokens:
        words = set(key_tokens(answer))
        hits = sum(1 for t in probe.tokens if t.lower() in words or t.lower() in said)
        if hits * 2 >= len(probe.tokens):
            return 0.5
    return 0.0


def judge_prompt(probe: Probe, answer: str) -> list[Message]:
    """The judge's messages: Factory's 0-5 grade of one answer against the reference."""
    return [
        {"role": "system", "content": (
            "You grade answers an AI coding agent gave about its own session. Grade 0-5: "
            "5 = correct and complete, exact strings (errors, paths, names) reproduced; "
            "3 = mostly right but missing or paraphrasing a key detail; 1 = vague or mostly "
            "wrong; 0 = wrong, invented or no answer. Reply with one line: 'Grade: N'.")},
        {"role": "user", "content": (
            f"Question ({probe.kind}): {probe.question}\n\nReference answer: {probe.reference}\n\n"
            f"Agent's answer: {answer}\n\nGrade:")},
    ]


def parse_grade(text: str | None) -> float | None:
    """The 0-5 grade in a judge's answer ("Grade: 4", "4/5", "**4**", "Score: 3.5"), or None."""
    if not text:
        return None
    for pattern in _GRADE_PATTERNS:
        found = pattern.search(text)
        if found:
            value = float(found.group(1))
            if 0 <= value <= 5:
                return value
    return None


# --- histories ---------------------------------------------------------------------------------


def _text(content: Any) -> str:
    """Content as plain text: strings as they are, the text of text parts and blocks (any
    format's spelling), a marker for what a text model can't be shown."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else orjson.dumps(content).decode()
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict):
            if isinstance(part.get("text"), str):
                out.append(part["text"])
            elif part.get("type") == "tool_result":
                out.append(_text(part.get("content")))
            elif part.get("type") in ("image", "image_url", "input_image"):
                out.append("[image]")
    return "\n".join(out)


def _calls_text(message: Message) -> str:
    calls = message.get("tool_calls") or ()
    return "\n".join(
        f"[called {c.get('function', {}).get('name')}({c.get('function', {}).get('arguments')})]"
        for c in calls if isinstance(c, dict))


def _plain(history: Sequence[Message], style: Style) -> list[Message]:
    """The pipeline's messages as messages any chat endpoint takes: role, text content and, in
    ``native`` style, tool calls and results as such. In ``text`` style (the default: every
    chat template takes it, tool-aware or not) calls become text in the assistant message,
    results user messages, and system messages after the conversation started (a summary)
    user messages: some templates refuse a system message anywhere but first."""
    out: list[Message] = []
    started = False
    for message in history:
        role = message.get("role")
        text = _text(message.get("content"))
        if role in ("system", "developer"):
            if started and style == "text":
                out.append({"role": "user", "content": f"[context]\n{text}"})
            else:
                out.append({"role": "system", "content": text})
            continue
        started = True
        if role in ("tool", "function"):
            if style == "native":
                out.append({"role": "tool", "tool_call_id": message.get("tool_call_id", ""),
                            "content": text})
            else:
                out.append({"role": "user", "content": f"[tool result]\n{text}"})
        elif role == "assistant":
            if style == "native":
                plain: Message = {"role": "assistant", "content": text}
                if message.get("tool_calls"):
                    plain["tool_calls"] = message["tool_calls"]
                out.append(plain)
            else:
                out.append({"role": "assistant",
                            "content": "\n".join(x for x in (text, _calls_text(message)) if x)})
        else:
            out.append({"role": "user", "content": text})
    return out


def chat_messages(fmt: str, body: Mapping[str, Any] | bytes | Sequence[Any], *,
                  style: Style = "text") -> list[Message]:
    """A body (or a bare history: chat messages, Responses input items, Anthropic messages) of
    format ``fmt`` as chat messages, read by that format's own reader."""
    if isinstance(body, bytes):
        raw = body
    elif isinstance(body, Mapping):
        raw = orjson.dumps({"model": "probe", **body})
    else:
        raw = orjson.dumps({"model": "probe", _HISTORY_FIELD[fmt]: list(body)})
    parsed = FORMATS[fmt].parse(raw, 1_000_000)
    return _plain(parsed.history, style)


# --- the endpoint ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    ms: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class ProbeError(Exception):
    """The endpoint failed or answered something that is not a completion."""


class ChatClient:
    """One pooled client for an OpenAI-compatible ``POST {base_url}/chat/completions``."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout_s: float = 120.0, max_tokens: int = 256, temperature: float = 0.0,
                 connections: int = 8) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=self.connections))
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def complete(self, messages: Sequence[Message], *,
                       max_tokens: int | None = None) -> Completion:
        if self._session is None:
            raise RuntimeError("use ChatClient as an async context manager")
        body = {"model": self.model, "messages": list(messages), "stream": False,
                "temperature": self.temperature, "max_tokens": max_tokens or self.max_tokens}
        started = time.perf_counter()
        try:
            async with self._session.post(self.url, data=orjson.dumps(body)) as response:
                raw = await response.read()
                if response.status != 200:
                    raise ProbeError(f"HTTP {response.status}: {raw[:300].decode(errors='replace')}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProbeError(f"{type(exc).__name__}: {exc}") from exc
        ms = (time.perf_counter() - started) * 1000
        try:
            data = orjson.loads(raw)
            text = data["choices"][0]["message"].get("content") or ""
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ProbeError(f"not a chat completion: {raw[:300]!r}") from exc
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        return Completion(text, ms, usage.get("prompt_tokens"), usage.get("completion_tokens"))


# --- running -----------------------------------------------------------------------------------


class CheckpointLike(Protocol):
    """What a checkpoint has, besides the client's history: ``full_body`` (the harness's name)
    or ``full_messages``, a body or a bare history in the checkpoint's format."""

    @property
    def format(self) -> str: ...
    @property
    def turn(self) -> int: ...
    @property
    def forwarded_body(self) -> Mapping[str, Any] | bytes: ...
    @property
    def canaries(self) -> Sequence[Any]: ...


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A point in a session to probe (the fidelity harness has its own; this one has the same
    fields, for callers without it)."""

    format: str
    turn: int
    full_body: Mapping[str, Any] | Sequence[Any]  # the client's body, or a bare history
    forwarded_body: Mapping[str, Any] | bytes
    canaries: Sequence[Any] = ()


@dataclass(frozen=True, slots=True)
class Answer:
    """One probe asked in one condition."""

    condition: Condition
    text: str | None  # None: the endpoint failed (error says how)
    score: float  # the rubric's
    grade: float | None = None  # the judge's 0-5, when asked and parsed
    error: str | None = None
    ms: float = 0.0
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    probe: Probe
    full: Answer
    slimmed: Answer


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    format: str
    turn: int
    full_messages: int  # chat messages shown in each condition
    slimmed_messages: int
    full_tokens: int  # counted as for gpt-4o (the proxy's counter): sizes, not the model's own
    slimmed_tokens: int
    results: tuple[ProbeResult, ...] = field(default=())

    def mean(self, condition: Condition, what: Literal["score", "grade"] = "score") -> float | None:
        values = [getattr(getattr(r, condition), what) for r in self.results]
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None


async def ask(client: ChatClient, probe: Probe, history: Sequence[Message],
              condition: Condition, *, judge: bool = False) -> Answer:
    """Ask ``probe`` after ``history``; score the answer, and grade it when ``judge``."""
    answer = await _answer(client, probe, history, condition)
    return await grade(client, probe, answer) if judge else answer


async def _answer(client: ChatClient, probe: Probe, history: Sequence[Message],
                  condition: Condition) -> Answer:
    try:
        done = await client.complete([*history, {"role": "user", "content": probe.question}])
    except ProbeError as exc:
        log.warning("probe %s (%s) failed: %s", probe.kind, condition, exc)
        return Answer(condition, None, 0.0, error=str(exc))
    return Answer(condition, done.text, rubric(probe, done.text), ms=done.ms,
                  prompt_tokens=done.prompt_tokens)


async def grade(client: ChatClient, probe: Probe, answer: Answer) -> Answer:
    """``answer`` with the judge's 0-5 grade (None when it failed or gave none)."""
    if answer.text is None:
        return answer
    try:
        verdict = await client.complete(judge_prompt(probe, answer.text), max_tokens=16)
    except ProbeError as exc:
        log.warning("judging %s (%s) failed: %s", probe.kind, answer.condition, exc)
        return answer
    return replace(answer, grade=parse_grade(verdict.text))


def histories(checkpoint: CheckpointLike, *, style: Style = "text"
              ) -> tuple[list[Message], list[Message]]:
    """The checkpoint's full and slimmed histories as chat messages."""
    full = getattr(checkpoint, "full_body", None)
    if full is None:
        full = getattr(checkpoint, "full_messages", None)
    if full is None:
        raise TypeError(f"a checkpoint needs full_body or full_messages: {checkpoint!r}")
    return (chat_messages(checkpoint.format, full, style=style),
            chat_messages(checkpoint.format, checkpoint.forwarded_body, style=style))


async def run_checkpoint(client: ChatClient, checkpoint: CheckpointLike, *, judge: bool = False,
                         style: Style = "text", concurrency: int = 1,
                         counter: TokenCounter | None = None) -> CheckpointResult:
    """Every probe of ``checkpoint`` asked with the full and with the slimmed history.
    ``concurrency``: requests in flight (1 suits a local model on a few cores)."""
    counter = counter or TokenCounter()
    full, slimmed = histories(checkpoint, style=style)
    probes = probes_for(checkpoint.canaries)
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(probe: Probe, history: list[Message], condition: Condition) -> Answer:
        async with gate:
            return await _answer(client, probe, history, condition)

    async def judged(probe: Probe, answer: Answer) -> Answer:
        async with gate:
            return await grade(client, probe, answer)

    # Every question after the full history, then every one after the slimmed, then the
    # judgements: consecutive requests share the longest prefix, which a server's prompt cache
    # (llama.cpp's, vLLM's prefix caching) reuses instead of reading the history again.
    conditions: tuple[tuple[list[Message], Condition], ...] = (
        (full, "full"), (slimmed, "slimmed"))
    answers = await asyncio.gather(*(one(p, h, c) for h, c in conditions for p in probes))
    if judge:
        answers = await asyncio.gather(*(judged(probes[i % len(probes)], a)
                                         for i, a in enumerate(answers)))
    n = len(probes)
    results = tuple(ProbeResult(p, answers[i], answers[n + i]) for i, p in enumerate(probes))
    return CheckpointResult(checkpoint.format, checkpoint.turn, len(full), len(slimmed),
                            counter.count_messages(full, _SIZE_MODEL),
                            counter.count_messages(slimmed, _SIZE_MODEL), results)


def format_table(results: Sequence[CheckpointResult], *, answers: bool = False) -> str:
    """Per probe: the rubric's score and the judge's grade, full vs slimmed; per checkpoint the
    history sizes and means. ``answers``: each answer's first line too."""

    def grade(a: Answer) -> str:
        return "-" if a.grade is None else f"{a.grade:g}"

    def mean(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"{'format':<9} {'turn':>4} {'probe':<12} {'score full':>10} {'slimmed':>7} "
             f"{'grade full':>10} {'slimmed':>7}  errors"]
    for cp in results:
        for r in cp.results:
            errors = "; ".join(f"{a.condition}: {a.error[:60]}" for a in (r.full, r.slimmed)
                               if a.error)
            lines.append(f"{cp.format:<9} {cp.turn:>4} {r.probe.kind:<12} {r.full.score:>10.1f} "
                         f"{r.slimmed.score:>7.1f} {grade(r.full):>10} {grade(r.slimmed):>7}  "
                         f"{errors}".rstrip())
            if answers:
                for a in (r.full, r.slimmed):
                    first = (a.text or "").strip().splitlines()[:1]
                    lines.append(f"{'':>16}{a.condition:>8}: {(first or [''])[0][:100]}")
        lines.append(
            f"{cp.format:<9} {cp.turn:>4} {'mean':<12} {mean(cp.mean('full')):>10} "
            f"{mean(cp.mean('slimmed')):>7} {mean(cp.mean('full', 'grade')):>10} "
            f"{mean(cp.mean('slimmed', 'grade')):>7}  history {cp.full_messages} msgs / "
            f"{cp.full_tokens} tokens full, {cp.slimmed_messages} / {cp.slimmed_tokens} slimmed")
    return "\n".join(lines)
