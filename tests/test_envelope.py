"""Client envelopes around tool output (proxy.filewise.envelope), with the real CLIs' shapes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.filewise.envelope import split_envelope

CLAUDE_READ = ('1\t"""Text wrapping and filling.\n2\t"""\n3\t\n492\n\n<system-reminder>\n'
               "<total_tokens>14977698 tokens left</total_tokens>\n</system-reminder>")
CLAUDE_TWO = ("1\tx = 1\n\n<system-reminder>\nWhenever you ... TaskCreate ...\n\n"
              "</system-reminder>\n\n<system-reminder>\n<total_tokens>14947989 tokens left"
              "</total_tokens>\n</system-reminder>")
CODEX_EXEC = ("Chunk ID: c408ff\nWall time: 0.0000 seconds\nProcess exited with code 0\n"
              'Original token count: 4930\nOutput:\n"""Text wrapping and filling.\n"""\n')
CODEX_PATCH = ("Exit code: 0\nWall time: 0 seconds\nOutput:\nSuccess. Updated the following "
               "files:\nM src/wrap.py\n")


def test_claude_codes_reminders_are_the_tail() -> None:
    e = split_envelope(CLAUDE_READ)
    assert e.head == "" and e.body == '1\t"""Text wrapping and filling.\n2\t"""\n3\t\n492'
    assert e.tail.startswith("\n\n<system-reminder>") and e.tail.endswith("</system-reminder>")
    two = split_envelope(CLAUDE_TWO)
    assert two.body == "1\tx = 1" and two.tail.count("<system-reminder>") == 2


def test_codexs_header_is_the_head() -> None:
    e = split_envelope(CODEX_EXEC)
    assert e.head.startswith("Chunk ID: c408ff") and e.head.endswith("Output:\n")
    assert e.body == '"""Text wrapping and filling.\n"""\n' and e.tail == ""
    assert split_envelope(CODEX_PATCH).body.startswith("Success.")


def test_a_reminder_inside_the_body_stays_there() -> None:
    text = "a <system-reminder>quoted</system-reminder> in code\nmore\n"
    assert split_envelope(text).body == text


@given(st.text(max_size=200), st.sampled_from(["", CLAUDE_READ, CODEX_EXEC, CLAUDE_TWO]))
def test_the_parts_are_the_text(noise: str, sample: str) -> None:
    for text in (noise, sample, noise + sample, sample + noise):
        e = split_envelope(text)
        assert e.head + e.body + e.tail == text
        assert e.wrap(e.body) == text
