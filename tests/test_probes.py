"""Model-in-the-loop probes (harness.probes): generation from canaries, the rubric, the
judge's grade, the three formats read into chat messages, and the client against a fake
OpenAI endpoint on loopback (full and slimmed both asked, scored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from harness.probes import (
    Canary,
    ChatClient,
    Checkpoint,
    Probe,
    as_canary,
    chat_messages,
    format_table,
    parse_grade,
    probes_for,
    rubric,
    run_checkpoint,
)
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_async

ERROR = "KeyError: 'tenant_id'"
CANARIES = [
    Canary("recall", ERROR, subject="the tenant tests", extra=("x-tenant-id",)),
    Canary("file", "src/tenant_scope.py", subject="created"),
    Canary("artifact", "legacy/auth_shim.py", subject="deleted"),
    Canary("decision", "zero external services", subject="SQLite over Postgres"),
    Canary("next_step", "migrations/0007_tenants.sql"),
    Canary("constraint", "keep the public API unchanged", subject="the user's constraint"),
]


def probe(expected: tuple[str, ...], tokens: tuple[str, ...] = ()) -> Probe:
    return Probe("recall", "q?", expected, tokens, " ".join(expected))


# --- generation --------------------------------------------------------------------------------


def test_one_probe_per_kind_and_one_per_decision() -> None:
    probes = probes_for([*CANARIES, Canary("decision", "less ops", subject="one node")])
    assert [p.kind for p in probes] == ["recall", "artifact", "continuation", "decision",
                                        "decision", "constraint"]
    recall, artifact, nxt, decision, decision2, constraint = probes
    assert recall.question.startswith("What were the exact error messages we ran into, and how "
                                      "did we fix them?")
    assert recall.expected == (ERROR, "x-tenant-id")
    assert "create, modify or delete" in artifact.question
    assert artifact.expected == ("src/tenant_scope.py", "legacy/auth_shim.py")
    assert "src/tenant_scope.py (created)" in artifact.reference
    assert nxt.question.startswith("What are the next steps")
    assert nxt.expected == ("migrations/0007_tenants.sql",)
    assert decision.question.startswith("Why did we choose SQLite over Postgres?")
    assert decision2.question.startswith("Why did we choose one node?")
    assert constraint.question.startswith("What hard rules or constraints did the user set?")
    # Derived key tokens: distinctive words, no stopwords.
    assert set(recall.tokens) >= {"keyerror", "tenant_id", "x-tenant-id"}
    assert "the" not in probes_for([Canary("recall", "the parser broke the build")])[0].tokens
    assert probes_for([Canary("mood", "calm", subject="the user's mood")])[0].question.startswith(
        "What was the user's mood? Quote it exactly.")


def test_the_fidelity_harness_canaries() -> None:
    """Its kinds (error and fix apart, deleted_file with a pattern, a decision "X because Y",
    a todo) as plain objects with kind, text and pattern."""

    @dataclass(frozen=True)
    class Planted:
        kind: str
        text: str
        step: int = -1
        pattern: str = ""

    planted = [
        Planted("error", ERROR), Planted("fix", "cfg.get('tenant_id', DEFAULT)"),
        Planted("deleted_file", "rm scratch/repro.py",
                pattern=r"scratch/repro\.py[^\n]*\b(?:deleted|removed)\b"),
        Planted("decision", "keep the token in Redis, not Postgres, because it must not lock"),
        Planted("todo", "add a leap-second test"), Planted("goal", "stop double charges"),
    ]
    recall, artifact, nxt, decision, goal = probes_for(planted)
    assert recall.expected == (ERROR, "cfg.get('tenant_id', DEFAULT)")
    assert decision.question.startswith("Why did we choose to keep the token in Redis, not "
                                        "Postgres?")
    assert decision.expected == ("it must not lock",)
    assert nxt.kind == "continuation" and goal.question.startswith("What is the goal")
    # The pattern counts as the text: "deleted scratch/repro.py" is the rm, said otherwise.
    assert rubric(artifact, "scratch/repro.py was deleted") == 1.0
    assert rubric(artifact, "rm scratch/repro.py") == 1.0
    assert rubric(artifact, "src/other.py") == 0.0


def test_canaries_from_mappings_and_objects() -> None:
    @dataclass
    class Planted:
        kind: str
        value: str
        about: str

    assert as_canary({"type": "decision", "text": "t", "subject": "x", "tokens": ["a"]}) == \
        Canary("decision", "t", "x", ("a",))
    assert as_canary(Planted("error", "boom", "the build")) == Canary("error", "boom", "the build")
    with pytest.raises(ValueError):
        as_canary({"kind": "recall"})


# --- scoring -----------------------------------------------------------------------------------


def test_rubric_exact_partial_none() -> None:
    p = probe((ERROR, "x-tenant-id"), ("keyerror", "tenant_id", "x-tenant-id"))
    # Exact: every expected string, case and whitespace aside.
    assert rubric(p, "It was keyerror:   'TENANT_ID'; fixed by reading x-tenant-id.") == 1.0
    # One of the expected strings: partial.
    assert rubric(p, f"The error was {ERROR}.") == 0.5
    # No exact string but enough key tokens: partial.
    assert rubric(p, "a KeyError on tenant_id") == 0.5
    # Too few key tokens, nothing, or no answer at all.
    assert rubric(p, "some KeyError") == 0.0
    assert rubric(p, "I don't know.") == 0.0
    assert rubric(p, None) == 0.0
    assert rubric(probe(("exact thing",)), "") == 0.0


def test_judge_grade_parser() -> None:
    assert parse_grade("Grade: 4") == 4
    assert parse_grade("grade=3.5, since the path is missing") == 3.5
    assert parse_grade("I'd give it **5**/5.") == 5
    assert parse_grade("The answer deserves 2 out of 5") == 2
    assert parse_grade("Score: 1") == 1
    assert parse_grade("**0**") == 0
    assert parse_grade("Grade: 9") is None
    assert parse_grade("The answer is good.") is None
    assert parse_grade(None) is None


# --- the formats, read into chat messages ------------------------------------------------------

SYSTEM = "You are a coding agent."
ARGS = '{"cmd":"pytest"}'  # as Messages' JSON input is written back
CHAT = {"model": "m", "messages": [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Fix the tests."},
    {"role": "assistant", "content": "Running them.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "c1", "content": f"E {ERROR}"},
    {"role": "assistant", "content": "Fixed."},
]}
RESPONSES = {"model": "m", "instructions": SYSTEM, "input": [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the tests."}]},
    {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Running them."}]},
    {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": ARGS},
    {"type": "function_call_output", "call_id": "c1", "output": f"E {ERROR}"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fixed."}]},
]}
MESSAGES = {"model": "m", "max_tokens": 100, "system": [{"type": "text", "text": SYSTEM}],
            "messages": [
    {"role": "user", "content": "Fix the tests."},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hidden", "signature": "sig"},
        {"type": "text", "text": "Running them."},
        {"type": "tool_use", "id": "c1", "name": "bash", "input": {"cmd": "pytest"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": f"E {ERROR}"}]}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Fixed."}]},
]}
TEXT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Fix the tests."},
    {"role": "assistant", "content": f"Running them.\n[called bash({ARGS})]"},
    {"role": "user", "content": f"[tool result]\nE {ERROR}"},
    {"role": "assistant", "content": "Fixed."},
]


@pytest.mark.parametrize(("fmt", "body"), [("chat", CHAT), ("responses", RESPONSES),
                                           ("messages", MESSAGES)])
def test_every_format_reads_into_the_same_chat_messages(fmt: str, body: dict[str, Any]) -> None:
    assert chat_messages(fmt, body) == TEXT
    assert chat_messages(fmt, orjson.dumps(body)) == TEXT  # a forwarded body's bytes
    native = chat_messages(fmt, body, style="native")
    assert [m["role"] for m in native] == ["system", "user", "assistant", "tool", "assistant"]
    assert native[2]["tool_calls"][0]["id"] == "c1"
    assert orjson.loads(native[2]["tool_calls"][0]["function"]["arguments"]) == {"cmd": "pytest"}
    assert native[3] == {"role": "tool", "tool_call_id": "c1", "content": f"E {ERROR}"}
    # Nothing format-private (signatures, reasoning, ride-along blocks) reaches the endpoint.
    assert all(set(m) <= {"role", "content", "tool_calls", "tool_call_id"} for m in native)


def test_a_bare_history_reads_like_its_body() -> None:
    assert chat_messages("chat", CHAT["messages"]) == TEXT
    assert chat_messages("responses", RESPONSES["input"]) == TEXT[1:]  # instructions are the body's


def test_a_summary_mid_conversation_becomes_a_user_message_in_text_style() -> None:
    history = [CHAT["messages"][0], {"role": "system", "content": "# Summary of previous"},
               {"role": "user", "content": "go on"},
               {"role": "system", "content": "late note"}]
    assert [m["role"] for m in chat_messages("chat", history)] == ["system", "system", "user",
                                                                    "user"]
    assert chat_messages("chat", history)[3]["content"] == "[context]\nlate note"
    assert chat_messages("chat", history, style="native")[3]["role"] == "system"


# --- the client, against a fake OpenAI endpoint ------------------------------------------------


def model(body: dict[str, Any]) -> Reply:
    """Answers from what it is shown: the planted error (and fix) if the history has it; as a
    judge, 5 for an answer holding the reference, 1 otherwise."""
    messages = body["messages"]
    if messages[0]["content"].startswith("You grade"):
        prompt = messages[-1]["content"]
        answer = prompt.split("Agent's answer: ")[1]
        return Reply(content="Grade: 5" if ERROR in answer else "Grade: 1")
    seen = "\n".join(m["content"] for m in messages[:-1])
    if ERROR in seen:
        return Reply(content=f"{ERROR}, fixed by reading x-tenant-id.")
    return Reply(content="I don't know.")


FULL = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix it."},
        {"role": "tool", "tool_call_id": "c1", "content": f"log...\nE {ERROR}\nFix: x-tenant-id"}]
SLIMMED = {"model": "m", "messages": [*FULL[:2], {"role": "tool", "tool_call_id": "c1",
                                                 "content": "log...\n<<<TRUNCATED>>>"}]}


async def test_full_and_slimmed_both_asked_and_scored() -> None:
    fake = FakeUpstream(responder=model)
    checkpoint = Checkpoint("chat", 3, FULL, SLIMMED, [Canary("recall", ERROR, extra=("x-tenant-id",))])
    async with serve_async(fake) as up:
        async with ChatClient(up.url + "/v1", "probe-model", api_key="sk-x", timeout_s=10) as client:
            result = await run_checkpoint(client, checkpoint, judge=True, concurrency=2)
    (only,) = result.results
    assert (only.full.score, only.slimmed.score) == (1.0, 0.0)
    assert (only.full.grade, only.slimmed.grade) == (5, 1)
    assert only.slimmed.text == "I don't know."
    assert result.mean("full") == 1.0 and result.mean("slimmed", "grade") == 1
    assert (result.full_messages, result.slimmed_messages) == (3, 3)
    assert result.full_tokens > result.slimmed_tokens
    # Two questions (full, slimmed) and two judgements, each as the endpoint expects.
    bodies = [r.json() for r in fake.received]
    assert len(bodies) == 4
    assert all(b["model"] == "probe-model" and b["stream"] is False for b in bodies)
    assert all(r.headers["authorization"] == "Bearer sk-x" for r in fake.received)
    asked = [b for b in bodies if not b["messages"][0]["content"].startswith("You grade")]
    assert sorted(len(b["messages"]) for b in asked) == [4, 4]
    assert all(b["messages"][-1]["content"] == only.probe.question for b in asked)
    table = format_table([result], answers=True)
    assert "recall" in table and "1.0" in table and "I don't know." in table


async def test_an_endpoint_failure_is_an_answer_with_its_error() -> None:
    fake = FakeUpstream()
    fake.script(Reply(status=500), "no grade here")
    checkpoint = Checkpoint("chat", 3, FULL, SLIMMED, [Canary("recall", ERROR)])
    async with serve_async(fake) as up:
        async with ChatClient(up.url + "/v1", "m", timeout_s=10) as client:
            result = await run_checkpoint(client, checkpoint)
    (only,) = result.results
    assert only.full.text is None and only.full.score == 0.0
    assert only.full.error is not None and "HTTP 500" in only.full.error
    assert only.slimmed.text == "no grade here" and only.slimmed.error is None
    assert "full: HTTP 500" in format_table([result])
    assert "authorization" not in fake.received[0].headers  # no key, no header
