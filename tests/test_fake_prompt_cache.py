"""The fake upstream's provider-like prompt cache (``FakeUpstream(prompt_cache=True)``,
:mod:`proxy.demo.fake.prompt_cache`): the cache alone, then served to the real SDKs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from proxy.demo.fake.prompt_cache import Prompt, PromptCache, cache_key, prompt_units, unit_tokens
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread

KEY = ("sk-ant-a", "claude-x")
MARK = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def text(n: int, tag: str = "") -> str:
    return f"{tag}{'w' * n}"


def block(n: int, tag: str = "", mark: dict[str, Any] | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"type": "text", "text": text(n, tag)}
    if mark is not None:
        b["cache_control"] = mark
    return b


def messages_body(turns: int, *, mark: dict[str, Any] | None = MARK, size: int = 400,
                  changed: int | None = None) -> dict[str, Any]:
    """A Messages request of ``turns`` user/assistant pairs and the next user turn (each turn
    appends to the one before); Claude Code's way: system marked, and a marker on the newest
    message only."""
    msgs: list[dict[str, Any]] = []
    for t in range(turns + 1):
        tag = "changed" if t == changed else f"u{t}"
        msgs.append({"role": "user", "content": [block(size, tag, mark if t == turns else None)]})
        if t < turns:
            msgs.append({"role": "assistant", "content": [block(size, f"a{t}")]})
    return {"model": "claude-x", "max_tokens": 100,
            "system": [block(size, "sys", mark)], "messages": msgs}


def tokens_of(api: str, body: dict[str, Any], upto: int | None = None) -> int:
    return sum(unit_tokens(u) for u in prompt_units(api, body)[:upto])


# --- the units -------------------------------------------------------------------------------


def test_units_strip_markers_and_order_tools_system_messages() -> None:
    body = {"tools": [{"name": "t", "cache_control": MARK}], "system": [block(4, "s", MARK)],
            "messages": [{"role": "user", "content": [block(4, "m", HOUR)]}]}
    units = prompt_units("messages", body)
    assert units == [b'[{"name":"t"}]', b'{"text":"swwww","type":"text"}',
                     b'{"content":[{"text":"mwwww","type":"text"}],"role":"user"}']
    # Moving a marker changes no unit.
    moved = {**body, "messages": [{"role": "user", "content": [block(4, "m")]}]}
    assert prompt_units("messages", moved) == units
    # Responses: instructions after the tools, a string input is one user message.
    assert prompt_units("responses", {"instructions": "be", "input": "hi"}) == [
        b'"be"', b'{"content":"hi","role":"user"}']
    assert unit_tokens(b"ab") == 1 and unit_tokens(b"x" * 41) == 10


# --- Anthropic ------------------------------------------------------------------------------


def test_append_only_session_reads_a_growing_prefix() -> None:
    cache = PromptCache()
    first = messages_body(1)
    p1 = cache.account("messages", KEY, first, 0.0)
    total1 = tokens_of("messages", first)
    assert p1 == Prompt(tokens=total1, read=0, write_5m=total1)
    second = messages_body(2)  # the answer and a new turn appended, the marker moved to it
    p2 = cache.account("messages", KEY, second, 1.0)
    total2 = tokens_of("messages", second)
    assert p2.read == total1  # the marker moved: the units it was on are the same
    assert p2.write_5m == total2 - total1 and p2.uncached == 0
    third = messages_body(3)
    p3 = cache.account("messages", KEY, third, 2.0)
    assert p3.read == total2 and p3.write_5m == tokens_of("messages", third) - total2


def test_a_changed_early_message_makes_the_later_units_written_again() -> None:
    cache = PromptCache()
    cache.account("messages", KEY, messages_body(3), 0.0)
    changed = messages_body(3, changed=1)  # the second user message differs
    p = cache.account("messages", KEY, changed, 1.0)
    units_before = 1 + 2  # system, u0, a0: the same
    assert p.read == tokens_of("messages", changed, units_before)
    assert p.write_5m == tokens_of("messages", changed) - p.read


def test_tokens_after_the_last_marker_are_plain_input() -> None:
    cache = PromptCache()
    body = messages_body(2, mark=None)
    body["system"] = [block(400, "sys", MARK)]  # only the system prompt is marked
    p = cache.account("messages", KEY, body, 0.0)
    assert p.write_5m == tokens_of("messages", body, 1) and p.read == 0
    assert p.uncached == tokens_of("messages", body) - p.write_5m
    again = cache.account("messages", KEY, body, 1.0)
    assert again.read == p.write_5m and again.write == 0  # reads stop at the last marker


def test_messages_without_markers_cache_nothing() -> None:
    cache = PromptCache()
    body = messages_body(2, mark=None)
    body["system"] = [block(400, "sys")]
    for now in (0.0, 1.0):
        p = cache.account("messages", KEY, body, now)
        assert p == Prompt(tokens=tokens_of("messages", body))


def test_a_top_level_marker_caches_the_whole_prompt() -> None:
    cache = PromptCache()
    body = {**messages_body(1, mark=None), "cache_control": MARK}
    assert cache.account("messages", KEY, body, 0.0).write_5m == tokens_of("messages", body)
    assert cache.account("messages", KEY, body, 1.0).read == tokens_of("messages", body)


def test_ttl_lapse_gives_no_read_and_a_read_refreshes() -> None:
    cache = PromptCache()
    body = messages_body(1)
    total = tokens_of("messages", body)
    cache.account("messages", KEY, body, 0.0)
    assert cache.account("messages", KEY, body, 299.0).read == total  # refreshed at 299
    assert cache.account("messages", KEY, body, 598.0).read == total
    lapsed = cache.account("messages", KEY, body, 598.0 + 301)
    assert lapsed.read == 0 and lapsed.write_5m == total


def test_one_hour_markers_live_an_hour_and_are_written_apart() -> None:
    cache = PromptCache()
    body = messages_body(1, mark=MARK)
    body["system"] = [block(400, "sys", HOUR)]  # 1h on the system prompt, 5m on the newest
    p = cache.account("messages", KEY, body, 0.0)
    system = tokens_of("messages", body, 1)
    assert p.write_1h == system and p.write_5m == tokens_of("messages", body) - system
    later = cache.account("messages", KEY, body, 1800.0)
    assert later.read == tokens_of("messages", body)  # the entry lives an hour
    assert cache.account("messages", KEY, body, 1800.0 + 3601).read == 0


def test_caches_are_per_key_and_model() -> None:
    cache = PromptCache()
    body = messages_body(1)
    cache.account("messages", KEY, body, 0.0)
    assert cache.account("messages", ("sk-ant-b", "claude-x"), body, 1.0).read == 0
    assert cache.account("messages", ("sk-ant-a", "claude-y"), body, 1.0).read == 0
    assert cache_key({"x-api-key": "k", "authorization": "Bearer o"}, "m") == ("k", "m")
    assert cache_key({"authorization": "Bearer o"}, "m") == ("Bearer o", "m")


# --- OpenAI -----------------------------------------------------------------------------------


def chat_body(*sizes: int) -> dict[str, Any]:
    return {"model": "gpt-x", "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text(n, f"m{i}")}
        for i, n in enumerate(sizes)]}


def test_openai_caches_prompts_of_1024_tokens_and_reads_in_128_token_steps() -> None:
    cache = PromptCache()
    key = ("Bearer sk-o", "gpt-x")
    small = chat_body(2000, 1000)  # ~750 tokens
    assert tokens_of("chat", small) < 1024
    cache.account("chat", key, small, 0.0)
    assert cache.account("chat", key, small, 1.0) == Prompt(tokens=tokens_of("chat", small))
    big = chat_body(3000, 1000, 1001)  # ~1250 tokens: cached whole after the call
    p1 = cache.account("chat", key, big, 2.0)
    assert p1.read == 0 and p1.write == 0  # OpenAI bills no writes
    grown = chat_body(3000, 1000, 1001, 500, 700)
    p2 = cache.account("chat", key, grown, 3.0)
    shared = tokens_of("chat", grown, 3)
    assert shared >= 1024 and shared % 128
    assert p2.read == shared // 128 * 128 and p2.write == 0
    # A shared prefix under 1024 tokens reads nothing, though it is cached.
    other = chat_body(3000, 999)
    assert tokens_of("chat", other, 1) < 1024
    assert cache.account("chat", key, other, 4.0).read == 0


def test_responses_items_cache_like_chat() -> None:
    cache = PromptCache()
    key = ("Bearer sk-o", "gpt-x")
    body = {"model": "gpt-x", "instructions": text(2000), "input": [
        {"type": "message", "role": "user", "content": text(3000)}]}
    cache.account("responses", key, body, 0.0)
    more = {**body, "input": [*body["input"], {"type": "message", "role": "user",
                                               "content": "next"}]}
    p = cache.account("responses", key, more, 1.0)
    assert p.read == tokens_of("responses", body) // 128 * 128 > 0


# --- served: the SDKs read it -----------------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, FakeUpstream]]:
    fake = FakeUpstream(prompt_cache=True)
    with serve_in_thread(fake) as srv:
        yield srv, fake


@pytest.fixture
def cached(served: tuple[ServerThread, FakeUpstream]) -> FakeUpstream:
    served[1].reset()
    return served[1]


def test_reset_restores_the_flag_clears_the_cache_and_the_clock() -> None:
    fake = FakeUpstream()
    assert fake.prompt_cache is False
    fake.prompt_cache = True
    fake.clock = lambda: 5.0
    fake.cache.account("chat", ("k", "m"), chat_body(5000), 0.0)
    fake.reset()
    assert fake.prompt_cache is False and fake.clock() != 5.0
    assert fake.cache.account("chat", ("k", "m"), chat_body(5000), 1.0).read == 0


def test_anthropic_sdk_reads_the_cache_usage(
    served: tuple[ServerThread, FakeUpstream], cached: FakeUpstream
) -> None:
    now = [100.0]
    cached.clock = lambda: now[0]
    body = messages_body(1, mark=MARK)
    body["system"] = [block(400, "sys", HOUR)]
    with anthropic.Anthropic(base_url=served[0].url, api_key="sk-ant-s", max_retries=0,
                             timeout=5) as client:
        first = client.messages.create(**body)
        system = tokens_of("messages", body, 1)
        total = tokens_of("messages", body)
        assert first.usage.cache_read_input_tokens == 0
        assert first.usage.cache_creation_input_tokens == total
        assert first.usage.cache_creation is not None
        assert first.usage.cache_creation.ephemeral_1h_input_tokens == system
        assert first.usage.cache_creation.ephemeral_5m_input_tokens == total - system
        assert first.usage.input_tokens == 0
        cached.script(Reply(content="streamed"))
        with client.messages.stream(**body) as stream:
            message = stream.get_final_message()
        assert message.usage.cache_read_input_tokens == total
        assert message.usage.cache_creation_input_tokens == 0 and message.usage.input_tokens == 0
        now[0] += 400  # past 5 minutes: a request with a 1h marker keeps its entry an hour
        third = client.messages.create(**body)
        assert third.usage.cache_read_input_tokens == total
    assert [r.prompt.read for r in cached.received if r.prompt] == [0, total, total]


def test_openai_sdk_reads_the_cache_usage(
    served: tuple[ServerThread, FakeUpstream], cached: FakeUpstream
) -> None:
    body = chat_body(3000, 1000, 1001)
    with openai.OpenAI(base_url=served[0].url + "/v1", api_key="sk-s", max_retries=0,
                       timeout=5) as client:
        first = client.chat.completions.create(**body)
        assert first.usage is not None and first.usage.prompt_tokens == tokens_of("chat", body)
        assert first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(client.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == tokens_of("chat", body) // 128 * 128
        rbody = {"model": "gpt-x", "input": [{"role": "user", "content": text(5000)}]}
        client.responses.create(**rbody)
        resp = client.responses.create(**rbody)
        assert resp.usage is not None
        assert resp.usage.input_tokens == tokens_of("responses", rbody)
        assert resp.usage.input_tokens_details.cached_tokens == (
            tokens_of("responses", rbody) // 128 * 128)


def test_scripted_usage_and_errors_are_left_alone(cached: FakeUpstream,
                                                  served: tuple[ServerThread, FakeUpstream]) -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
    cached.script(Reply(usage=usage), Reply.error(500))
    body = chat_body(5000)
    with openai.OpenAI(base_url=served[0].url + "/v1", api_key="sk-s", max_retries=0,
                       timeout=5) as client:
        assert client.chat.completions.create(**body).usage.model_dump(  # type: ignore[union-attr]
            exclude_none=True) == usage
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(**body)
        # Neither cached anything: the next call writes, reads nothing.
        plain = client.chat.completions.create(**body)
    assert plain.usage is not None and plain.usage.prompt_tokens_details is not None
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert [r.prompt is not None for r in cached.received] == [False, False, True]
