"""Log lines stay bounded whatever a client sends."""

from __future__ import annotations

import logging

import pytest

from proxy.logs import MAX_MESSAGE_CHARS, BoundedFormatter
from proxy.model import RequestView
from proxy.pipeline.validate import ValidateStage
from proxy.session import Identity


def _record(message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("proxy.x", logging.WARNING, __file__, 1, message, args, None)


def test_a_long_message_is_cut_and_says_how_much() -> None:
    line = BoundedFormatter("%(levelname)s %(message)s").format(_record("%s", "x" * 100_000))
    assert len(line) < MAX_MESSAGE_CHARS + 100
    assert line.endswith(f"... [{100_000 - MAX_MESSAGE_CHARS} more characters]")


def test_a_short_message_and_a_traceback_are_kept_whole() -> None:
    fmt = BoundedFormatter("%(message)s", max_chars=50)
    assert fmt.format(_record("short %d", 1)) == "short 1"
    try:
        raise ValueError("y" * 200)
    except ValueError:
        import sys
        record = _record("failed")
        record.exc_info = sys.exc_info()
    assert "y" * 200 in fmt.format(record)


def test_the_validators_warning_names_a_bounded_number_of_repairs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pipeline evicted an assistant turn of 2,000 calls: their results are orphans to drop
    (the client's own list was valid)."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for i in range(2000)]
    orphans = [{"role": "tool", "tool_call_id": f"call_{i}", "content": "x"} for i in range(2000)]
    client = [{"role": "user", "content": "go"},
              {"role": "assistant", "content": None, "tool_calls": calls}, *orphans]
    messages = [client[0], *orphans]
    view = RequestView("m", {"messages": client}, Identity("t", "s", None))
    with caplog.at_level(logging.WARNING, logger="proxy.pipeline"):
        ValidateStage()(messages, view)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.endswith("; and 1995 more") and len(line) < 1000
