"""Summarizer logic of the compactor: prompt, validation, user requests, fallback, insertion."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.compaction.prompt import (
    MIN_INPUT_CHARS,
    SYSTEM_PROMPT,
    build_prompt,
    omitted_marker,
    render_transcript,
    shorten,
)
from proxy.compaction.summarizer import (
    SECTIONS,
    SUMMARY_HEADING,
    USER_REQUESTS_HEADING,
    SummaryOutcome,
    UserRequests,
    clean_answer,
    fallback_summary,
    find_summary_message,
    is_summary_message,
    is_valid_summary,
    merge_user_requests,
    normalize_summary,
    parse_user_block,
    previous_from_messages,
    render_user_requests,
    split_user_block,
    summarize,
    summary_message,
    summary_problems,
    user_requests,
)

from .conftest import examples

FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])

GOOD = """## Goal
Fix the failing build of `/srv/app`.

## Constraints & Preferences
- Keep `/srv/app/setup.cfg` unchanged.

## Progress
### Done
- Ran `pytest -x tests/test_x.py`.
### In Progress
- Fixing `tests/test_x.py::test_parse`.
### Blocked
- None

## Key Decisions
- Use pytest, not unittest.

## Next Steps
- Rerun the tests.

## Critical Context
- `ValueError: bad thing` in `/srv/app/x.py` line 42.
"""

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/app/x.py", line 42, in parse\n'
    "ValueError: bad thing\n"
)


def call(cid: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Fix the build in /srv/app. Do not touch /srv/app/setup.cfg."},
        {"role": "assistant", "content": "Reading the file.",
         "tool_calls": [call("c1", "read_file", file_path="/srv/app/x.py")]},
        {"role": "tool", "tool_call_id": "c1", "content": "def parse():\n" + "    pass\n" * 2000},
        {"role": "assistant", "content": None,
         "tool_calls": [call("c2", "bash", command="pytest -x tests/test_x.py")]},
        {"role": "tool", "tool_call_id": "c2",
         "content": "collected 3 items\n" + "." * 3000 + "\nFAILED tests/test_x.py::test_parse\n" + TRACEBACK},
        {"role": "user", "content": [
            {"type": "text", "text": "Here is a screenshot of the error."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5000}},
        ]},
        {"role": "assistant", "content": "Next I will fix parse() in /srv/app/x.py."},
    ]


def transcript_of(prompt: list[dict[str, Any]]) -> str:
    user: str = prompt[1]["content"]
    return user[user.index("<transcript>\n") + 13 : user.rindex("\n</transcript>")]


class Scripted:
    """An injected `complete`: answers in order (an Exception instance is raised)."""

    def __init__(self, *answers: str | BaseException) -> None:
        self.answers = list(answers)
        self.prompts: list[list[dict[str, Any]]] = []

    async def __call__(self, prompt: list[dict[str, Any]]) -> str:
        self.prompts.append(prompt)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


# -- prompt ---------------------------------------------------------------------------------


def test_prompt_is_deterministic_and_holds_the_material() -> None:
    ev = conversation()
    p1 = build_prompt("## Goal\nOld goal `src/old.py`", ev)
    p2 = build_prompt("## Goal\nOld goal `src/old.py`", [dict(m) for m in ev])
    assert p1 == p2
    assert [m["role"] for m in p1] == ["system", "user"]
    system = p1[0]["content"]
    for heading in SECTIONS:
        assert f"\n{heading}\n" in system
    assert "verbatim" in system.lower() and "merge" in system.lower() and "preamble" in system
    user = p1[1]["content"]
    assert "<previous_summary>\n## Goal\nOld goal `src/old.py`\n</previous_summary>" in user
    text = transcript_of(p1)
    assert "[1] USER:\nFix the build in /srv/app. Do not touch /srv/app/setup.cfg." in text
    assert 'CALL read_file({"file_path": "/srv/app/x.py"})' in text
    assert "[3] TOOL RESULT (read_file):\ndef parse():" in text
    assert "[5] TOOL RESULT (bash):" in text and "ValueError: bad thing" in text  # tail kept
    assert "[image]" in text and "base64" not in text
    assert text.count("chars omitted ...]") == 2


def test_prompt_without_previous_says_so() -> None:
    user = build_prompt(None, conversation())[1]["content"]
    assert "no previous summary" in user and "<previous_summary>" not in user


def test_tool_output_shortened_head_tail_with_exact_count() -> None:
    out = "\n".join(f"line {i}" for i in range(1000))
    short = shorten(out, 500)
    assert len(short) <= 500
    head, marker, tail = short.split("\n[... ")[0], short.split("[... ")[1].split(" chars")[0], short
    assert out.startswith(head) and out.endswith(tail.split("omitted ...]\n")[1])
    kept = len(head) + len(tail.split("omitted ...]\n")[1])
    assert int(marker) == len(out) - kept
    assert shorten("small", 500) == "small"


@given(st.text(max_size=3000), st.integers(100, 2000))
@FAST
def test_shorten_bound_and_count(text: str, limit: int) -> None:
    short = shorten(text, limit)
    assert len(short) <= limit
    if short != text:
        head, rest = short.split("\n[... ", 1)
        n, tail = rest.split(" chars omitted ...]\n", 1)
        assert text.startswith(head) and text.endswith(tail)
        assert int(n) == len(text) - len(head) - len(tail) > 0


def test_transcript_bound_keeps_newest_and_says_what_was_dropped() -> None:
    ev = [{"role": "user", "content": f"message {i} " + "x" * 500} for i in range(100)]
    text = render_transcript(ev, max_chars=5000)
    assert len(text) <= 5000
    assert text.startswith("[... ") and "earlier messages of these turns" in text
    assert "message 99 " in text and "message 0 " not in text
    dropped = int(text.split("[... ")[1].split(" earlier")[0])
    assert f"[{dropped + 1}] USER:\nmessage {dropped} " in text
    # The newest message alone over the bound is cut, not dropped.
    huge = render_transcript([{"role": "user", "content": "y" * 50_000}], max_chars=2000)
    assert len(huge) <= 2000 and "[1] USER:" in huge
    with pytest.raises(ValueError):
        render_transcript(ev, max_chars=MIN_INPUT_CHARS - 1)


def test_previous_summary_is_never_cut() -> None:
    previous = GOOD + "- detail\n" * 5000
    ev = [{"role": "user", "content": "z" * 10_000}] * 10
    prompt = build_prompt(previous, ev, max_input_chars=2000)
    assert previous.strip() in prompt[1]["content"]
    assert len(transcript_of(prompt)) <= 2000


# -- validation -----------------------------------------------------------------------------


def test_valid_summary_accepted_with_tolerated_variants() -> None:
    assert is_valid_summary(GOOD)
    assert is_valid_summary(GOOD + "\n## Files\n- a.py\n")  # extra section
    assert is_valid_summary(GOOD.replace("## Goal", "## **Goal:**  "))
    assert is_valid_summary(GOOD.replace("## Constraints & Preferences", "## constraints and preferences"))
    assert is_valid_summary(GOOD.replace("## Next Steps", "## 5. Next Steps ##"))
    assert normalize_summary(GOOD.replace("## Goal", "## **Goal:**")).startswith("## Goal\n")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (GOOD.replace("## Next Steps\n", ""), "`## Next Steps`"),
        (GOOD.replace("### Blocked", "## Blocked"), "found `## Blocked` instead"),
        (GOOD.replace("## Goal\n", "## Key Decisions\n", 1), "more than once"),
        (GOOD.replace("## Key Decisions", "## Critical Context", 1).replace(
            "## Critical Context\n- `Value", "## Key Decisions\n- `Value"), "must come after"),
        (GOOD.replace("## Progress\n", "## Progress\n## Notes\n"), "must be inside `## Progress`"),
        (GOOD.replace("Fix the failing build of `/srv/app`.", ""), "`## Goal` is empty"),
        ("\n".join(SECTIONS[:1] + ("x",) + SECTIONS[1:]), "empty"),
        ("```\n" + GOOD + "```\n", "missing sections"),  # headings inside a fence do not count
        ("no sections here", "missing sections"),
    ],
)
def test_invalid_summaries_rejected(text: str, problem: str) -> None:
    assert not is_valid_summary(text)
    assert problem in "; ".join(summary_problems(text))


def test_clean_answer_strips_fence_and_preamble() -> None:
    assert clean_answer("```markdown\n" + GOOD + "```") == GOOD.strip()
    assert clean_answer("Sure! Here it is:\n\n```md\n" + GOOD + "```\nHope it helps.") == GOOD.strip()
    assert clean_answer("# Summary\n\n" + GOOD) == GOOD.strip()
    inner = GOOD.replace("- Rerun the tests.", "- Rerun:\n```bash\npytest -x\n```")
    assert clean_answer("```\n" + inner + "\n```") == inner.strip()
    assert clean_answer(inner) == inner.strip()  # its own code block stays
    assert clean_answer("garbage") == "garbage"


# -- summarize ------------------------------------------------------------------------------


async def test_valid_first_answer_one_attempt() -> None:
    complete = Scripted(GOOD)
    out = await summarize(complete, None, conversation())
    assert out == SummaryOutcome(out.text, "model", 1, None)
    body, entries = split_user_block(out.text)
    assert body == GOOD.strip()
    assert entries == [
        "Fix the build in /srv/app. Do not touch /srv/app/setup.cfg.",
        "Here is a screenshot of the error.",
    ]
    assert is_valid_summary(out.text)
    assert complete.prompts == [build_prompt(None, conversation())]


async def test_invalid_then_valid_retries_with_missing_sections() -> None:
    bad = GOOD.replace("## Next Steps\n- Rerun the tests.\n", "").replace("### Blocked\n- None\n", "")
    complete = Scripted(bad, GOOD)
    out = await summarize(complete, None, conversation())
    assert (out.source, out.attempts, out.error) == ("model", 2, None)
    second = complete.prompts[1]
    assert second[:2] == complete.prompts[0]
    assert second[2] == {"role": "assistant", "content": bad}
    reminder = second[3]["content"]
    assert second[3]["role"] == "user"
    assert "`## Next Steps`" in reminder and "`### Blocked`" in reminder
    assert "`## Goal`" not in reminder.split("\n\n")[0]  # only what is actually missing


async def test_invalid_twice_falls_back() -> None:
    out = await summarize(Scripted("no sections here", "still nothing"), None, conversation())
    assert (out.source, out.attempts) == ("fallback", 2)
    assert out.error is not None and "invalid summary" in out.error and "## Goal" in out.error
    assert is_valid_summary(out.text) and USER_REQUESTS_HEADING in out.text


# asyncio.TimeoutError is the builtin TimeoutError since 3.11.
@pytest.mark.parametrize("exc", [RuntimeError("HTTP 500"), TimeoutError()])
async def test_raising_complete_falls_back_with_error(exc: Exception) -> None:
    complete = Scripted(exc)
    out = await summarize(complete, GOOD, conversation())
    assert (out.source, out.attempts) == ("fallback", 1)
    assert out.error is not None and type(exc).__name__ in out.error
    assert "Fix the failing build of `/srv/app`." in out.text  # the previous summary is kept
    assert is_valid_summary(out.text)


async def test_timeout_bounds_each_call() -> None:
    async def slow(prompt: list[dict[str, Any]]) -> str:
        await asyncio.sleep(10)
        return GOOD

    out = await summarize(slow, None, conversation(), timeout=0.01)
    assert out.source == "fallback" and out.error is not None and "TimeoutError" in out.error


async def test_cancellation_propagates() -> None:
    with pytest.raises(asyncio.CancelledError):
        await summarize(Scripted(asyncio.CancelledError()), None, conversation())

    started = asyncio.Event()

    async def hang(prompt: list[dict[str, Any]]) -> str:
        started.set()
        await asyncio.sleep(10)
        return GOOD

    task = asyncio.ensure_future(summarize(hang, None, conversation()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_fenced_answer_stripped_and_echoed_block_replaced() -> None:
    echoed = GOOD + "\n" + USER_REQUESTS_HEADING + "\n**Request 1**\n> made up by the model\n"
    out = await summarize(Scripted("Here you go:\n```markdown\n" + echoed + "```"), None, conversation())
    assert out.source == "model" and out.text.startswith("## Goal\n")
    assert "```" not in out.text and "made up by the model" not in out.text
    assert out.text.count(USER_REQUESTS_HEADING) == 1


async def test_previous_given_as_whole_summary_message_is_unwrapped() -> None:
    first = await summarize(Scripted(GOOD), None, conversation())
    wrapped = summary_message(first.text, pointer="dialog/2026-12-02.jsonl lines 1-7", tool_name=None)
    complete = Scripted(GOOD)
    await summarize(complete, wrapped["content"], [{"role": "user", "content": "go on"}])
    user = complete.prompts[0][1]["content"]
    assert SUMMARY_HEADING not in user and "<previous_summary>\n## Goal" in user


# -- user requests --------------------------------------------------------------------------


def test_user_requests_verbatim_text_parts_only_and_cut() -> None:
    ev: list[dict[str, Any]] = [
        {"role": "user", "content": "  keep `this` exactly\r\n## not a heading  "},
        {"role": "assistant", "content": "ignored"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": "w" * 5000},
    ]
    entries = user_requests(ev, per_message_chars=300)
    assert entries[0] == "keep `this` exactly\n## not a heading"
    assert len(entries) == 2 and len(entries[1]) <= 300
    head, _, tail = entries[1].split("\n")
    assert set(head + tail) == {"w"} and _ == omitted_marker(5000 - len(head) - len(tail))
    block = render_user_requests(entries)
    assert "> ## not a heading" in block
    assert parse_user_block(GOOD + "\n" + block) == (GOOD.strip(), UserRequests(tuple(entries)))


async def test_user_block_merged_across_two_compactions() -> None:
    span1 = [{"role": "user", "content": "TASK: port lib/a.py to Rust; never use unsafe."}]
    span1 += [{"role": "user", "content": f"step {i} " + "s" * 80} for i in range(5)]
    span2 = [{"role": "user", "content": f"later {i} " + "l" * 80} for i in range(5)]
    first = await summarize(Scripted(GOOD), None, span1, total_chars=10_000)
    assert split_user_block(first.text)[1][0].startswith("TASK:")
    assert len(split_user_block(first.text)[1]) == 6
    second = await summarize(Scripted(RuntimeError("down")), first.text, span2, total_chars=500)
    body, requests = parse_user_block(second.text)
    assert requests.entries[0] == "TASK: port lib/a.py to Rust; never use unsafe."
    assert requests.entries[-1].startswith("later 4 ")
    assert sum(len(e) for e in requests.entries) <= 500
    assert requests.omitted == 11 - len(requests.entries) > 0
    kept_numbers = [line for line in second.text.split("\n") if line.startswith("**Request ")]
    assert kept_numbers[0] == "**Request 1**" and kept_numbers[-1] == "**Request 11**"
    assert f"*[... {requests.omitted} requests omitted here ...]*" in second.text
    # A third compaction keeps counting the old omissions.
    third = await summarize(Scripted(GOOD), second.text, [{"role": "user", "content": "last"}], total_chars=500)
    _, again = parse_user_block(third.text)
    assert again.entries[0].startswith("TASK:") and again.entries[-1] == "last"
    assert len(again.entries) + again.omitted == 12


def test_merge_keeps_first_and_newest_even_when_large() -> None:
    merged = merge_user_requests(UserRequests(("a" * 100,), 2), ["b" * 100, "c" * 100], total_chars=150)
    assert merged == UserRequests(("a" * 100, "c" * 100), 3)


@given(
    st.lists(st.text(min_size=1, max_size=200).map(lambda s: s.replace("\r", "").strip()).filter(bool),
             max_size=8),
    st.integers(0, 5),
)
@FAST
def test_user_block_round_trip(entries: list[str], omitted: int) -> None:
    requests = UserRequests(tuple(entries), omitted if entries else 0)
    text = "## Goal\n```\nunclosed" + "\n\n" + render_user_requests(requests)
    assert parse_user_block(text)[1] == requests


# -- fallback -------------------------------------------------------------------------------


def test_fallback_is_valid_deterministic_with_errors_and_paths() -> None:
    ev = conversation()
    text = fallback_summary(None, ev)
    assert is_valid_summary(text) and text == fallback_summary(None, [dict(m) for m in ev])
    body, entries = split_user_block(text)
    goal = body.split("## Goal\n")[1].split("\n\n")[0]
    assert "Fix the build in /srv/app" in goal
    assert 'read_file({"file_path": "/srv/app/x.py"}) → def parse():' in body
    assert "bash(" in body and "pytest -x tests/test_x.py" in body
    assert "Error in tool output: FAILED tests/test_x.py::test_parse" in body
    assert "Error in tool output: ValueError: bad thing" in body
    assert "Error in tool output: Traceback (most recent call last):" in body
    assert "`/srv/app/x.py`" in body.split("## Critical Context")[1]
    assert "Next I will fix parse() in /srv/app/x.py." in body.split("## Next Steps")[1]
    assert "Do not touch /srv/app/setup.cfg." in body.split("## Constraints & Preferences")[1]
    assert len(entries) == 2


def test_fallback_merges_previous_sections() -> None:
    previous = GOOD + "\n## Files\n- `src/keep.py`\n"
    text = fallback_summary(previous, conversation())
    assert is_valid_summary(text)
    for line in GOOD.strip().split("\n"):
        if line.strip() and line != "- None":
            assert line in text, line
    assert text.index("- Ran `pytest -x tests/test_x.py`.") < text.index("read_file(")
    assert "## Files\n- `src/keep.py`" in text
    # Blocked was "None": replaced by the new item rather than kept beside it.
    blocked = text.split("### Blocked\n")[1].split("\n\n")[0]
    assert blocked.startswith("- The last tool result") and "- None" not in blocked


def test_fallback_with_nothing_is_still_valid() -> None:
    assert is_valid_summary(fallback_summary(None, []))
    assert is_valid_summary(fallback_summary("garbage\n```\n## Goal", [{"role": "tool", "content": "x"}]))


# -- insertion ------------------------------------------------------------------------------


def test_summary_message_format_and_round_trip() -> None:
    text = fallback_summary(None, conversation())
    msg = summary_message(text + "\n\n", pointer="dialog/2026-12-02.jsonl lines 3-240",
                          tool_name="read_offloaded")
    assert msg["role"] == "system"
    lines = msg["content"].split("\n")
    assert lines[0] == "# Summary of previous conversation"
    assert "dialog/2026-12-02.jsonl lines 3-240" in lines[1] and "end backwards" in lines[1]
    assert "call `read_offloaded` with file_path=dialog/2026-12-02.jsonl" in lines[1]
    assert "start_line=221" in lines[1]
    assert lines[2] == "" and lines[3] == "## Goal"
    assert lines[-2] == "" and "continuity" in lines[-1] and "re-asking" in lines[-1]
    assert msg["content"] == "\n".join([lines[0], lines[1], "", text.strip(), "", lines[-1]])
    assert is_summary_message(msg)
    assert not is_summary_message({"role": "user", "content": msg["content"]})
    assert not is_summary_message({"role": "system", "content": "You are helpful."})
    history = [{"role": "system", "content": "sys"}, msg, {"role": "user", "content": "hi"}]
    assert find_summary_message(history) == 1
    assert previous_from_messages(history) == text.strip()
    assert previous_from_messages(history[:1]) is None
    as_parts = {"role": "developer", "content": [{"type": "text", "text": msg["content"]}]}
    assert previous_from_messages([as_parts]) == text.strip()


def test_summary_message_pointer_variants() -> None:
    two = summary_message(GOOD, pointer="dialog/a.jsonl lines 1-40, dialog/b.jsonl lines 1-9",
                          tool_name="read_offloaded")["content"].split("\n")[1]
    assert "file_path=dialog/b.jsonl" in two and "start_line=1)" in two
    plain = summary_message(GOOD, pointer="dialog/a.jsonl line 7", tool_name=None)["content"]
    assert "dialog/a.jsonl line 7" in plain and "end backwards." in plain and "call `" not in plain
    bare = summary_message(GOOD, pointer="", tool_name="read_offloaded")["content"].split("\n")
    assert bare[1].endswith("into the summary below.") and bare[3] == "## Goal"
    assert previous_from_messages([{"role": "system", "content": "\n".join(bare)}]) == GOOD.strip()


# -- properties -----------------------------------------------------------------------------

TEXT_BITS = st.sampled_from([
    "## Goal", "### Done", "# Title", "```", "~~~~", "```python", "> quote", "Traceback (most recent call last):",
    "ValueError: x", "FAILED t.py", "error[E0308]:", "src/a.py", "## User Requests (verbatim)",
    "**Request 3**", "*[... 2 requests omitted here ...]*", "\r\n", "\n", "\n\n", "  ", "\t", "é", "🙂", "\u2028",
])
TEXT = st.lists(st.one_of(TEXT_BITS, st.text(max_size=30)), max_size=12).map("".join)
ARGS = st.one_of(
    TEXT,
    st.dictionaries(st.sampled_from(["path", "file_path", "command", "x"]), TEXT, max_size=3).map(json.dumps),
)
CONTENT = st.one_of(
    st.none(),
    TEXT,
    st.lists(st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, TEXT),
        st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
        st.just({"type": "input_audio", "input_audio": {"data": "x"}}),
    ), max_size=3),
)
IDS = st.sampled_from(["c1", "c2", "c3"])
MESSAGE = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, CONTENT),
    st.builds(lambda c: {"role": "system", "content": c}, CONTENT),
    st.builds(
        lambda c, calls: {"role": "assistant", "content": c, **({"tool_calls": calls} if calls else {})},
        CONTENT,
        st.lists(st.builds(lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
                           IDS, st.sampled_from(["bash", "read_file", ""]), ARGS), max_size=3),
    ),
    st.builds(lambda i, c: {"role": "tool", "tool_call_id": i, "content": c}, IDS, CONTENT),
)
CONVERSATION = st.lists(MESSAGE, max_size=12)


@given(CONVERSATION, st.one_of(st.none(), TEXT, st.just(GOOD)), CONVERSATION)
@FAST
def test_fallback_always_valid(evicted: list[dict[str, Any]], previous: str | None,
                               later: list[dict[str, Any]]) -> None:
    first = fallback_summary(previous, evicted, per_message_chars=200, total_chars=600)
    assert is_valid_summary(first), summary_problems(first)
    assert first == fallback_summary(previous, evicted, per_message_chars=200, total_chars=600)
    second = fallback_summary(first, later, per_message_chars=200, total_chars=600)
    assert is_valid_summary(second), summary_problems(second)
    _, before = parse_user_block(first)
    _, after = parse_user_block(second)
    if before.entries:
        assert after.entries[0] == before.entries[0]  # the task statement is never dropped


@given(CONVERSATION, st.one_of(st.none(), TEXT), st.integers(MIN_INPUT_CHARS, 3000),
       st.integers(100, 500))
@FAST
def test_prompt_always_bounded_and_deterministic(
    evicted: list[dict[str, Any]], previous: str | None, limit: int, tool_chars: int
) -> None:
    big = evicted * 5
    prompt = build_prompt(previous, big, max_input_chars=limit, tool_output_chars=tool_chars)
    assert prompt == build_prompt(previous, big, max_input_chars=limit, tool_output_chars=tool_chars)
    transcript = render_transcript(big, max_chars=limit, tool_output_chars=tool_chars)
    assert len(transcript) <= limit
    assert transcript in prompt[1]["content"]
    overhead = len(prompt[1]["content"]) - len(transcript) - len((previous or "").strip())
    assert prompt[0]["content"] == SYSTEM_PROMPT and overhead < 400


SECTION_SOUP = st.lists(
    st.one_of(st.sampled_from([*SECTIONS, "## Notes", "### User Requests (verbatim)", "```", "```md",
                               "Sure:", "- item `a.py`", "x" * 50]), TEXT),
    max_size=25,
).map("\n".join)


@given(st.one_of(SECTION_SOUP, st.just(GOOD).map(lambda g: "```markdown\n" + g + "```")),
       CONVERSATION, st.one_of(st.none(), st.just(GOOD)))
@FAST
def test_every_outcome_is_valid_with_the_user_block(
    answer: str, evicted: list[dict[str, Any]], previous: str | None
) -> None:
    out = asyncio.run(summarize(Scripted(answer, answer), previous, evicted))
    assert is_valid_summary(out.text), (out.source, summary_problems(out.text))
    assert out.source == ("model" if is_valid_summary(clean_answer(answer)) else "fallback")
    assert out.attempts == (1 if out.source == "model" else 2)
    _, requests = parse_user_block(out.text)
    assert list(requests.entries) == user_requests(evicted)
    assert out.text.rstrip().split("\n").count(USER_REQUESTS_HEADING) >= 1
