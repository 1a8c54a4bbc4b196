"""Epochs, for every wire format: a session's forwarded history only grows between two
compactions (pipeline.epoch).

An append-only client (it resends its whole history plus what is new, as agents do) talks to a
real proxy whose window a few turns overflow; tool outputs of every size arrive (small, cut at
stage 1, aged later). For each pair of consecutive forwarded requests of the session, either the
summary in use is the same and the later request opens with the whole earlier one (system,
tools and instructions unchanged; ``cache_control`` markers aside, as the provider's prefix
check and prompt cache ignore them), or a compaction happened: a summary never seen before in
the session, made by a summarizer call.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread
from proxy.formats.messages.request import strip_cache_control

from .conftest import ProxyFactory

SUMMARY = """## Goal
Keep the build green.
## Constraints & Preferences
- none
## Progress
### Done
- ran steps
### In Progress
- more steps
### Blocked
- nothing
## Key Decisions
- none
## Next Steps
- continue
## Critical Context
- the steps print their output
"""

SIZES = {"small": 300, "medium": 6_000, "large": 20_000, "huge": 70_000}
MODELS = {"chat": "gpt-4o", "responses": "gpt-5.1-codex", "messages": "claude-sonnet-4-5"}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
CONVERSATION = {"chat": "messages", "responses": "input", "messages": "messages"}
FIXED = {"chat": ("tools",), "responses": ("instructions", "tools"),
         "messages": ("system", "tools")}


def output(n: int, size: str) -> str:
    line = f"step {n} line " + "z" * 50
    lines = [f"{line} {i}" for i in range(1, SIZES[size] // 64 + 2)]
    return "\n".join(lines)


def turn(fmt: str, n: int, size: str) -> list[dict[str, Any]]:
    text = output(n, size)
    if fmt == "chat":
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{n}", "type": "function",
                     "function": {"name": "bash", "arguments": '{"cmd":"step"}'}}]},
                {"role": "tool", "tool_call_id": f"call_{n}", "content": text}]
    if fmt == "responses":
        return [{"type": "reasoning", "id": f"rs_{n}", "summary": [],
                 "encrypted_content": f"gAAAA-opaque-{n}"},
                {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}",
                 "name": "bash", "arguments": '{"cmd":"step"}', "status": "completed"},
                {"type": "function_call_output", "call_id": f"call_{n}", "output": text}]
    return [{"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"step {n} next", "signature": f"sig-{n}"},
                {"type": "tool_use", "id": f"toolu_{n}", "name": "bash",
                 "input": {"cmd": "step"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": text,
                 "cache_control": {"type": "ephemeral"}}]}]


def user(fmt: str, text: str) -> dict[str, Any]:
    if fmt == "responses":
        return {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]}
    return {"role": "user", "content": text}


def body(fmt: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    model = MODELS[fmt]
    if fmt == "chat":
        return {"model": model, "messages": [{"role": "system", "content": "You run steps."},
                                             *history],
                "tools": [{"type": "function", "function": {
                    "name": "bash", "parameters": {"type": "object"}}}]}
    if fmt == "responses":
        return {"model": model, "instructions": "You run steps.", "input": history,
                "store": False, "tools": [{"type": "function", "name": "bash",
                                           "parameters": {"type": "object"}}]}
    return {"model": model, "max_tokens": 1024,
            "system": [{"type": "text", "text": "You run steps.",
                        "cache_control": {"type": "ephemeral"}}],
            # Only the newest turn keeps its marker, as Claude Code moves its own: the API
            # takes at most 4 cache breakpoints.
            "messages": [*strip_cache_control(history[:-1]), *history[-1:]],
            "tools": [{"name": "bash", "input_schema": {"type": "object"}}]}


def is_summarizer(req: dict[str, Any]) -> bool:
    """The proxy's summarizer call, in the session's own format."""
    return own_call(req) == "summarizer"




def summary_of(conversation: list[Any]) -> bytes | None:
    for item in conversation:
        raw = orjson.dumps(item)
        if SUMMARY_HEADING.encode() in raw:
            return raw
    return None


@pytest.fixture
def epochs_proxy(make_proxy: ProxyFactory, fake: FakeUpstream) -> ServerThread:
    def responder(req: dict[str, Any]) -> Reply:
        return Reply(content=SUMMARY if is_summarizer(req) else "ok")

    fake.responder = responder
    return make_proxy({"compaction": {"context_windows": {m: 40_000 for m in MODELS.values()}}})


def run_session(srv: ServerThread, fake: FakeUpstream, fmt: str,
                steps: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Post the growing history once per step; the session's forwarded model requests and how
    many summarizer calls were made."""
    session = f"epoch-{fmt}-{uuid.uuid4().hex[:12]}"
    history: list[dict[str, Any]] = [user(fmt, "run the steps and keep the build green")]
    first = len(fake.received)
    headers = {"authorization": "Bearer sk-test", "x-api-key": "sk-ant-test",
               "anthropic-version": "2023-06-01", "x-session-id": session}
    with httpx.Client(timeout=60) as client:
        for n, step in enumerate(steps):
            if step == "user":
                history.append(user(fmt, f"now step {n}, please"))
                if fmt == "messages":  # Anthropic wants alternation: an answer first
                    history.insert(-1, {"role": "assistant",
                                        "content": [{"type": "text", "text": f"done {n}"}]})
            else:
                history += turn(fmt, n, step)
            r = client.post(srv.url + PATHS[fmt], content=orjson.dumps(body(fmt, history)),
                            headers=headers)
            assert r.status_code == 200, r.text[:300]
    received = fake.received[first:]
    forwarded = [rec.json() for rec in received if rec.path == PATHS[fmt]
                 and not is_summarizer(rec.json())]
    summaries = sum(1 for rec in received if is_summarizer(rec.json()))
    return forwarded, summaries


def check_epochs(fmt: str, forwarded: list[dict[str, Any]], summaries: int) -> int:
    """The epoch rule over consecutive forwarded requests; the number of compactions seen."""
    key = CONVERSATION[fmt]
    seen: set[bytes] = set()
    boundaries = 0
    for prev, nxt in zip(forwarded, forwarded[1:], strict=False):
        a, b = strip_cache_control(prev), strip_cache_control(nxt)
        before, after = summary_of(a[key]), summary_of(b[key])
        if before == after:
            for field in FIXED[fmt]:
                assert a.get(field) == b.get(field), field
            assert b[key][: len(a[key])] == a[key], "a forwarded item changed mid-epoch"
        else:
            assert after is not None and after not in seen, "a summary came back"
            boundaries += 1
        if after is not None:
            seen.add(after)
    assert boundaries <= summaries
    return boundaries


@pytest.mark.parametrize("fmt", ["chat", "responses", "messages"])
def test_a_long_session_compacts_and_stays_append_only_between(
    epochs_proxy: ServerThread, fake: FakeUpstream, fmt: str
) -> None:
    steps = ["huge", "large", "medium", "huge", "small", "large", "user", "huge", "large",
             "medium", "huge", "large", "small", "huge", "large", "user", "huge", "large"]
    forwarded, summaries = run_session(epochs_proxy, fake, fmt, steps)
    assert len(forwarded) == len(steps)
    assert check_epochs(fmt, forwarded, summaries) >= 2  # several epochs, each append-only
    # The read tool is in ``tools`` from the first request on: it never changes mid-session.
    names = [orjson.dumps(f["tools"]) for f in forwarded]
    assert len(set(names)) == 1 and b"read_offloaded" in names[0]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fmt=st.sampled_from(["chat", "responses", "messages"]),
       steps=st.lists(st.sampled_from([*SIZES, "user"]), min_size=2, max_size=16))
def test_any_session_is_append_only_within_an_epoch(
    epochs_proxy: ServerThread, fake: FakeUpstream, fmt: str, steps: list[str]
) -> None:
    forwarded, summaries = run_session(epochs_proxy, fake, fmt, steps)
    check_epochs(fmt, forwarded, summaries)
