"""A provider's error message made safe to log and store (proxy.upstream.redact)."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.upstream.redact import MESSAGE_CHARS, error_summary, redact

TEMPERATURE = ("Unsupported value: 'temperature' does not support 0 with this model. Only the "
               "default (1) value is supported.")
secret = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=4, max_size=60)
prose = st.text(max_size=200)


@given(prose, secret, prose)
def test_a_credential_it_was_sent_with_never_survives(before: str, key: str, after: str) -> None:
    assert key not in redact(before + key + after, [key])


@given(prose, st.sampled_from(["sk-", "sk-proj-", "sk-ant-api03-", "sk-ant-oat01-", "rk-"]),
       st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=6,
               max_size=60), prose)
def test_a_key_shaped_token_never_survives(before: str, prefix: str, body: str,
                                           after: str) -> None:
    key = prefix + body
    text = redact(f"{before} {key} {after}")
    assert key not in text


def test_the_message_itself_survives() -> None:
    body = orjson.dumps({"error": {"message": TEMPERATURE, "type": "invalid_request_error",
                                   "param": "temperature", "code": "unsupported_value"}})
    assert error_summary(body) == (f"{TEMPERATURE} (type=invalid_request_error, "
                                   "code=unsupported_value)")
    anthropic = orjson.dumps({"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "model: claude-sonnet-4-5-20250929 does not accept temperature"}})
    assert error_summary(anthropic) == ("model: claude-sonnet-4-5-20250929 does not accept "
                                        "temperature (type=invalid_request_error)")


def test_echoed_keys_tokens_and_control_characters() -> None:
    body = orjson.dumps({"error": {
        "message": "Incorrect API key provided: sk-proj-abc123. Bearer eyJhbGciOiJI.eyJzdWIi.x "
                   "token=Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA==\nnext line",
        "code": "invalid_api_key"}})
    text = error_summary(body, ["mine-1234"])
    assert text == ("Incorrect API key provided: [redacted]. [redacted] [redacted] next line "
                    "(code=invalid_api_key)")


@given(st.text(max_size=5000))
def test_always_one_bounded_line(message: str) -> None:
    text = error_summary(orjson.dumps({"error": {"message": message}}))
    assert len(text) <= MESSAGE_CHARS and "\n" not in text and "\r" not in text


def test_no_error_object_says_nothing() -> None:
    assert error_summary(b"<html>502</html>") == ""
    assert error_summary(b'{"detail": "x"}') == ""
