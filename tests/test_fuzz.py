"""Generated hostile input against the proxy: never a proxy-made 5xx, never a crash, every error
in its route's envelope (OpenAI's; Anthropic's for ``/v1/messages``), every stream terminated,
nothing stored for a request refused.

The generators live in :mod:`harness.fuzz` (``bench/fuzz.py`` runs them too); the names
this module always had (``Gen``, ``hostile_responder``, ``MAX_BODY_MB``, ...) are still
importable from here.

* Hypothesis drives chat JSON *values* (the proxy in process).
* :class:`Gen` generates chat request *bytes* in volume against a real server (torn bodies and
  resets would show on the wire); the fake model answers some read-tool rounds with hostile
  ``read_offloaded`` arguments. The default suite runs 400; ``CTXPROXY_STRESS=1`` runs the
  10,000-request ``stress`` variant (``python -m pytest tests/test_fuzz.py -m stress -n 0``
  with the variable set), which prints its figures.
* :class:`Mutator` mutates realistic bodies of each format (Claude Code's and Codex's recorded
  requests, a chat conversation of the same calls) in process: a few hundred cases per format
  by default, ``CTXPROXY_FUZZ_CASES`` of them when set (``.ci/run`` sets 10,000), seeded.
  After them a canary request of the format must come out right.
* The shapes the mutation fuzz found crashing the proxy (500s, stages skipped) are regression
  tests by their exact bodies.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.fuzz import _HOSTILE_PATHS as _HOSTILE_PATHS
from harness.fuzz import FORMATS, TINY, Case, cases, envelope_ok, judge, responder, seeds
from harness.fuzz import MAX_BODY_MB as MAX_BODY_MB
from harness.fuzz import PIXEL as PIXEL
from harness.fuzz import READ_TOOL as READ_TOOL
from harness.fuzz import Crashes as Crashes
from harness.fuzz import Gen as Gen
from harness.fuzz import _notice as _notice
from harness.fuzz import hostile_responder as hostile_responder
from harness.inprocess import InProcess
from proxy import rawjson as json
from proxy.app import create_app
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.errors import BadRequest
from proxy.formats.body import MAX_DEPTH
from proxy.formats.chat.request import parse as parse_chat
from proxy.truncation.notice import MARKER

from .conftest import ENVELOPE_KEYS, InProcessFactory, examples, proxy_config

# --- JSON values (hypothesis, in process) -------------------------------------------------------

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
)
_json = st.recursive(
    _leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=16,
)
_role = st.sampled_from(["user", "assistant", "tool", "system", "developer", "function", "nope", None])
_part = st.one_of(_json, st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "file", "x"])},
    optional={"text": _json, "image_url": _json}))
_call = st.fixed_dictionaries({"id": _json, "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": _json, "arguments": _json})})
_message = st.one_of(_json, st.fixed_dictionaries({"role": _role}, optional={
    "content": st.one_of(_json, st.lists(_part, max_size=3), st.text(max_size=4000)),
    "tool_calls": st.one_of(_json, st.lists(_call, max_size=3)),
    "tool_call_id": _json, "name": _json}))
_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just("gpt-4o"), _json), "messages": st.one_of(st.lists(_message, max_size=6), _json)},
    optional={"stream": _json, "max_tokens": _json, "tools": _json, "metadata": _json, "user": _json,
              "stream_options": _json, "prompt_cache_key": _json})


def test_generated_requests_never_get_a_proxy_5xx(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> None:
    """Synchronous for hypothesis: the app runs in a loop of this test's own, driven one
    request at a time."""
    fake.strict = False  # hostile input on purpose: the proxy's handling of it is under test
    with asyncio.Runner() as runner:
        app = runner.run(InProcess(create_app(proxy_config(fake_url, tmp_path / "data"))).start())

        @settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(_body)
        def one(body: dict[str, object]) -> None:
            r = runner.run(app.client.post(
                "/v1/chat/completions", content=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)))
            assert r.status_code < 500, (r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert set(r.json()["error"]) == ENVELOPE_KEYS

        try:
            one()
        finally:
            runner.run(app.stop())


async def test_message_count_limit(make_inproc: InProcessFactory) -> None:
    app = await make_inproc({"server": {"max_messages": 10}})
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 11})
    r = await app.client.post("/v1/chat/completions", content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "at most 10" in r.json()["error"]["message"]


# --- request bytes in volume (a real server) ---------------------------------------------------

STRESS = os.environ.get("CTXPROXY_STRESS") == "1"


@dataclass
class Figures:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    proxy_5xx: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    envelope_failures: list[str] = field(default_factory=list)
    unterminated_streams: list[str] = field(default_factory=list)
    # How far the requests got: answers with an offload, a compaction, a read-tool round.
    reached: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def failures(self) -> dict[str, list[str]]:
        return {"proxy 5xx": self.proxy_5xx, "crashes": self.crashes,
                "envelope": self.envelope_failures, "streams": self.unterminated_streams}


def check(figures: Figures, index: int, response: httpx.Response, stream: bool) -> None:
    where = f"#{index} {response.status_code} {response.content[:200]!r}"
    with figures.lock:
        figures.requests += 1
        figures.statuses[response.status_code] += 1
        h = response.headers
        figures.reached["offloaded"] += h.get("x-ctxproxy-offloaded", "0") not in ("0", "")
        figures.reached["compacted"] += h.get("x-ctxproxy-compacted") == "1"
        figures.reached["read_rounds"] += h.get("x-ctxproxy-read-rounds", "0") not in ("0", "")
        figures.reached["streamed"] += h.get("content-type", "").startswith("text/event-stream")
    if response.status_code >= 500:  # the fake never answers 5xx: the proxy made it
        with figures.lock:
            figures.proxy_5xx.append(where)
    if response.status_code >= 400:
        try:
            err = orjson.loads(response.content)["error"]
            ok = (response.headers.get("content-type", "").startswith("application/json")
                  and set(err) == ENVELOPE_KEYS and isinstance(err["message"], str)
                  and err["message"] and isinstance(err["type"], str))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            with figures.lock:
                figures.envelope_failures.append(where)
    elif stream and response.headers.get("content-type", "").startswith("text/event-stream"):
        tail = response.content[-300:]
        if not (tail.endswith(b"data: [DONE]\n\n") or b'"error"' in tail):
            with figures.lock:
                figures.unterminated_streams.append(where)


def send_one(client: httpx.Client, url: str, index: int, seed: int, figures: Figures) -> None:
    gen = Gen(seed * 1_000_003 + index)
    body = gen.body()
    headers = gen.headers()
    path = "/v1/chat/completions" if gen.chance(0.9) else "/chat/completions"
    stream = b'"stream":true' in body
    try:
        response = client.post(url + path, content=body, headers=headers)
    except httpx.HTTPError as exc:  # a reset, a torn body, a hang: the proxy broke
        with figures.lock:
            figures.requests += 1
            figures.crashes.append(f"#{index} {type(exc).__name__}: {exc}")
        return
    check(figures, index, response, stream)



@dataclass
class Rig:
    proxy: ServerThread
    fake: FakeUpstream
    data: Path


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """A proxy in front of its own non-recording fake (10,000 bodies would pile up in the
    shared one), with a tiny context window so compaction runs too."""
    # strict=False: hostile input on purpose (tool messages without calls, unknown roles...),
    # answered as before so the proxy's whole path runs on it.
    fake = FakeUpstream(responder=hostile_responder, record=False, strict=False)
    with serve_in_thread(fake) as upstream:
        config = proxy_config(upstream.url + "/v1", tmp_path / "data", {
            "upstream": {"timeout_s": 30},
            "server": {"max_body_mb": MAX_BODY_MB},
            "compaction": {"context_windows": {"tiny": 3000}},
        })
        with serve_in_thread(create_app(config), lifespan="on") as srv:
            yield Rig(srv, fake, tmp_path / "data")


def run(rig: Rig, count: int, seed: int, workers: int = 4) -> tuple[Figures, list[str], float]:
    figures = Figures()
    crashes = Crashes()
    loggers = [logging.getLogger(n) for n in ("proxy", "uvicorn.error", "asyncio")]
    for logger in loggers:
        logger.addHandler(crashes)
    started = time.monotonic()
    try:
        clients = [httpx.Client(timeout=60) for _ in range(workers)]
        try:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda i: send_one(clients[i % workers], rig.proxy.url, i, seed,
                                                 figures), range(count)))
            health = clients[0].get(rig.proxy.url + "/healthz")
            assert health.status_code == 200 and rig.proxy.running
        finally:
            for c in clients:
                c.close()
    finally:
        for logger in loggers:
            logger.removeHandler(crashes)
    return figures, crashes.records, time.monotonic() - started


def report(figures: Figures, logged: list[str], seconds: float) -> str:
    lines = [f"requests={figures.requests} seconds={seconds:.1f} "
             f"statuses={dict(sorted(figures.statuses.items()))} reached={dict(figures.reached)}",
             f"proxy_5xx={len(figures.proxy_5xx)} crashes={len(figures.crashes)} "
             f"logged_errors={len(logged)} envelope_failures={len(figures.envelope_failures)} "
             f"unterminated_streams={len(figures.unterminated_streams)}"]
    for name, items in figures.failures().items():
        lines += [f"  {name}: {item}" for item in items[:5]]
    lines += [f"  logged: {item}" for item in logged[:5]]
    return "\n".join(lines)


def assert_clean(figures: Figures, logged: list[str], seconds: float, count: int) -> None:
    text = report(figures, logged, seconds)
    assert figures.requests == count, text
    assert not any(figures.failures().values()) and not logged, text
    # The generator must reach the interesting answers, not only one kind of 400.
    assert figures.statuses[200] > count // 10 and figures.statuses[400] > count // 10, text
    assert figures.statuses[413] > 0, text
    assert all(figures.reached[k] > 0 for k in ("offloaded", "compacted", "read_rounds",
                                                 "streamed")), text


def test_generated_bytes_never_break_the_proxy(rig: Rig) -> None:
    figures, logged, seconds = run(rig, 400, seed=1)
    assert_clean(figures, logged, seconds, 400)


@pytest.mark.stress
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not STRESS, reason="stress run: set CTXPROXY_STRESS=1")
def test_ten_thousand_generated_requests(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    count = int(os.environ.get("CTXPROXY_FUZZ_COUNT", "10000"))
    figures, logged, seconds = run(rig, count, seed=int(os.environ.get("CTXPROXY_FUZZ_SEED", "7")))
    with capsys.disabled():
        print("\n" + report(figures, logged, seconds))
    assert_clean(figures, logged, seconds, count)


def _nested(levels: int) -> bytes:
    """A body whose nesting is ``levels`` deep in all (the body object is level 1)."""
    inner = levels - 3  # body > messages > message, then arrays in a field no one reads
    return (b'{"model": "m", "messages": [{"role": "user", "content": "x", "x": ' + b"[" * inner
            + b"]" * inner + b"}]}")


@pytest.mark.parametrize(("raw", "param", "words"), [
    (b'{"model": "m", "messages": [5]}', "messages[0]", "got an integer"),
    (b'{"model": "m", "messages": [{"role": "user"}, "hi"]}', "messages[1]", "got a string"),
    (b'{"model": "m", "messages": [null]}', "messages[0]", "got null"),
    (b'{"model": "m", "messages": [{"role": ["user"]}]}', "messages[0].role", "got an array"),
    (b'{"model": "m", "messages": [{"role": 1}]}', "messages[0].role", "got an integer"),
    (b'{"model": "m", "messages": [{"role": "assistant", "tool_calls": 5}]}',
     "messages[0].tool_calls", "expected an array"),
    (b'{"model": "m", "messages": [{"role": "assistant", "tool_calls": {"a": 1}}]}',
     "messages[0].tool_calls", "got an object"),
    (_nested(MAX_DEPTH + 1), None, "nested more than 128 levels"),
    (b'{"model": "m", "messages": [], "x": ' + b"[" * 300 + b"]" * 300 + b"}", None, "nested"),
])
def test_what_the_pipeline_cannot_take_is_a_clear_400(
    raw: bytes, param: str | None, words: str
) -> None:
    """Shapes the fuzz found crashing pipeline stages (non-object messages, a list as role, a
    number as tool_calls) or the serializer (deeper than orjson writes: 254 levels)."""
    with pytest.raises(BadRequest) as info:
        parse_chat(raw)
    assert info.value.param == param and words in info.value.message


@pytest.mark.parametrize("raw", [
    _nested(MAX_DEPTH),
    b'{"model": "m", "messages": [{"role": "ipython", "content": "x"}]}',  # other providers' roles
    b'{"model": "m", "messages": [{"content": "x"}, {"role": null}]}',  # the upstream judges
    b'{"model": "m", "messages": [{"role": "assistant", "tool_calls": null}]}',
])
def test_what_the_pipeline_can_take_passes(raw: bytes) -> None:
    assert parse_chat(raw)["model"] == "m"


# --- realistic bodies of each format, mutated (in process) -------------------------------------

FUZZ_CASES = int(os.environ.get("CTXPROXY_FUZZ_CASES", "300"))
FUZZ_SEED = int(os.environ.get("CTXPROXY_FUZZ_SEED", "11"))
#: Where each format keeps its conversation in a body.
ITEMS = {"chat": "messages", "responses": "input", "messages": "messages"}
BIG, TINY_BIG = 1, 3  # seed variants: a big tool output (offload); the same on the tiny model


def stored(data: Path) -> dict[str, tuple[int, int]]:
    """What the proxy has stored: each file under its data directory, by size and mtime."""
    return {str(p.relative_to(data)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in data.rglob("*") if p.is_file()}


@pytest.fixture
async def fuzz_app(tmp_path: Path) -> AsyncIterator[tuple[InProcess, FakeUpstream, Path]]:
    """The proxy in process in front of its own non-recording fake (the hostile read-tool
    model), a 3,000-token ``tiny`` model so compaction runs too."""
    # Not strict: hostile bodies the proxy forwards as sent are the provider's to refuse, and
    # a refusal here would read as the proxy's own.
    fake = FakeUpstream(responder=responder, record=False, strict=False)
    data = tmp_path / "data"
    with serve_in_thread(fake) as upstream:
        config = proxy_config(upstream.url + "/v1", data, {
            "upstream": {"timeout_s": 30}, "server": {"max_body_mb": MAX_BODY_MB},
            "compaction": {"context_windows": {TINY: 3000}}})
        async with InProcess(create_app(config)) as app:
            yield app, fake, data


async def canary(app: InProcess, fake: FakeUpstream, fmt: str) -> None:
    """The format's recorded body with a big tool output, in a session of its own: answered,
    the output cut, every other item forwarded byte for byte."""
    raw = orjson.dumps(seeds(fmt)[BIG])
    fake.record = True
    try:
        r = await app.client.post(FORMATS[fmt], content=raw,
                                  headers={"x-session-id": f"canary-{fmt}"})
    finally:
        fake.record = False
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "1", r.text[:300]
    first = fake.received[-1 - int(r.headers.get("x-ctxproxy-read-rounds", "0"))]
    sent = json.array_items(json.members(first.body)[ITEMS[fmt]])
    given = json.array_items(json.members(raw)[ITEMS[fmt]])
    changed = [a for a, b in zip(sent, given, strict=True) if a != b]
    assert len(changed) == 1 and MARKER.encode() in bytes(changed[0])


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("fmt", ["chat", "responses", "messages"])
async def test_mutated_realistic_bodies_never_break_the_proxy(
    fmt: str, fuzz_app: tuple[InProcess, FakeUpstream, Path]
) -> None:
    """Each case answered without a proxy 5xx or a logged error, every error in the route's
    envelope, every stream ended; a refused case reached nobody and stored nothing; the proxy
    alive and a canary right afterwards."""
    app, fake, data = fuzz_app
    crashes = Crashes()
    loggers = [logging.getLogger(n) for n in ("proxy", "asyncio")]
    for logger in loggers:
        logger.addHandler(crashes)
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    refused: list[Case] = []

    async def nothing_stored() -> None:
        """Each refused case once more, alone in a quiet proxy: it reaches nobody upstream and
        stores nothing (checked in batches: waiting for quiet after every case would cost more
        than the cases)."""
        await app.drain()
        for case in refused:
            before, calls = stored(data), fake.request_count
            await app.client.post(FORMATS[fmt], content=case.raw)
            await app.drain()
            if stored(data) != before or fake.request_count != calls:
                failures.append(f"#{case.index} refused, but stored or forwarded something")
        refused.clear()

    try:
        for case in cases(fmt, FUZZ_CASES, FUZZ_SEED):
            r = await app.client.post(FORMATS[fmt], content=case.raw)
            statuses[r.status_code] += 1
            verdict = judge(fmt, r.status_code, r.headers.get("content-type", ""), r.content,
                            case.stream)
            if verdict:
                failures.append(f"{verdict} #{case.index} {r.status_code} {r.content[:200]!r}")
            if 400 <= r.status_code < 500:
                refused.append(case)
            if len(refused) == 100:
                await nothing_stored()
        await nothing_stored()
        before = stored(data)
        await canary(app, fake, fmt)
        await app.drain()
        # The check above can fail: what a request stores shows.
        assert stored(data) != before
        health = await app.client.get("/healthz")
    finally:
        for logger in loggers:
            logger.removeHandler(crashes)
    text = f"{fmt}: {dict(sorted(statuses.items()))}\n" + "\n".join(
        [*failures[:10], *crashes.records[:10]])
    assert not failures and not crashes.records and health.status_code == 200, text
    assert sum(statuses.values()) == FUZZ_CASES, text
    # The mutations must reach the pipeline as well as the refusals.
    assert statuses[200] > FUZZ_CASES // 4 and statuses[400] > FUZZ_CASES // 10, text


# --- what the mutation fuzz found: refused with the field named, or forwarded as sent -----------


def mutated(fmt: str, variant: int, path: tuple[str | int, ...], value: Any) -> bytes:
    """Seed ``variant`` of ``fmt`` with the value at ``path`` replaced (the fuzz's finds, as
    the exact bodies they were)."""
    body = copy.deepcopy(seeds(fmt)[variant])
    inner = body
    for step in path[:-1]:
        inner = inner[step]
    inner[path[-1]] = value
    return orjson.dumps(body)




@pytest.mark.parametrize(("fmt", "raw", "param"), [
    # proxy 500: retrieval.tool's with_tool read a tool's function that is a number.
    ("chat", mutated("chat", 0, ("tools", 0, "function"), 1.5), "tools[0].function"),
    ("chat", mutated("chat", 0, ("tools", 1, "custom"), "apply_patch"), "tools[1].custom"),
    # offload skipped ("forwarding without it"): a tool_call_id that is an object.
    ("chat", mutated("chat", BIG, ("messages", 5, "tool_call_id"), {"type": "call_rec_0"}),
     "messages[5].tool_call_id"),
    ("chat", mutated("chat", BIG, ("messages", 5, "tool_call_id"), ["call_rec_0"]),
     "messages[5].tool_call_id"),
    # compaction skipped: a content part whose type is an array.
    ("chat", mutated("chat", TINY_BIG, ("messages", 2, "content", 0, "type"), []),
     "messages[2].content[0].type"),
    # proxy 500: formats.responses read a leading item whose role is an object.
    ("responses", mutated("responses", 0, ("input", 0, "role"), {"role": "developer"}),
     "input[0].role"),
    ("responses", mutated("responses", 0, ("input", 2, "type"), ["message"]), "input[2].type"),
    # proxy 500: formats.messages read a block whose type is an object, or an array.
    ("messages", mutated("messages", 0, ("messages", 1, "content", 0, "type"),
                         {"type": "thinking"}), "messages.1.content.0.type"),
    ("messages", mutated("messages", 0, ("messages", 3, "content", 1, "type"), ["tool_use"]),
     "messages.3.content.1.type"),
    # compaction skipped: a tool_result block whose type is an array.
    ("messages", mutated("messages", TINY_BIG, ("messages", 6, "content", 0, "type"), []),
     "messages.6.content.0.type"),
])
async def test_what_the_proxy_cannot_read_is_the_formats_400(
    fmt: str, raw: bytes, param: str, fuzz_app: tuple[InProcess, FakeUpstream, Path]
) -> None:
    app, fake, data = fuzz_app
    crashes = Crashes()
    logging.getLogger("proxy").addHandler(crashes)
    before = stored(data)
    try:
        r = await app.client.post(FORMATS[fmt], content=raw)
        await app.drain()
    finally:
        logging.getLogger("proxy").removeHandler(crashes)
    assert r.status_code == 400 and not crashes.records, (r.text, crashes.records)
    assert envelope_ok(fmt, r.status_code, r.headers["content-type"], r.content)
    if fmt == "messages":  # Anthropic's envelope: the path leads the message
        assert r.json()["error"]["message"].startswith(f"{param}: "), r.text
    else:
        assert r.json()["error"]["param"] == param, r.text
    assert fake.request_count == 0 and stored(data) == before


@pytest.mark.parametrize(("fmt", "raw"), [
    # The validator used to "repair" these: the orphan dropped, a placeholder for the call.
    ("chat", mutated("chat", BIG, ("messages", 5, "tool_call_id"), "call_77")),
    ("chat", mutated("chat", BIG, ("messages", 4, "tool_calls"), [])),
    ("responses", mutated("responses", BIG, ("input", 4, "call_id"), "call_77")),
    ("messages", mutated("messages", BIG, ("messages", 2, "content", 0, "tool_use_id"),
                         "toolu_77")),
    # What the proxy does not read, whatever it is.
    ("chat", mutated("chat", BIG, ("messages", 3, "content", 0, "type"), "input_text_2027")),
    ("responses", mutated("responses", BIG, ("input", 5), {"type": "new_item", "x": [1.0e1]})),
    ("responses", mutated("responses", BIG, ("input", 5), {  # its id names the call
        "type": "local_shell_call_output", "id": "lsc_1", "output": '{"stdout": "ok"}'})),
    ("messages", mutated("messages", BIG, ("messages", 1, "content", 0),
                         {"type": "new_block", "data": {"v": 1.50}})),
    ("messages", mutated("messages", BIG, ("messages", 2, "content", 0, "is_error"), "maybe")),
])
async def test_what_the_proxy_can_read_goes_upstream_as_sent(
    fmt: str, raw: bytes, fuzz_app: tuple[InProcess, FakeUpstream, Path]
) -> None:
    """A conversation whose pairing the client broke, or with types and fields the proxy
    does not know: the provider judges it, and gets it as the client sent it (the big output
    cut, the rest byte for byte)."""
    app, fake, _ = fuzz_app
    fake.record = True
    r = await app.client.post(FORMATS[fmt], content=raw)
    assert r.status_code == 200, r.text
    sent = json.array_items(json.members(fake.received[0].body)[ITEMS[fmt]])
    given = json.array_items(json.members(raw)[ITEMS[fmt]])
    changed = [bytes(a) for a, b in zip(sent, given, strict=True) if a != b]
    assert len(changed) == 1 and MARKER.encode() in changed[0]
