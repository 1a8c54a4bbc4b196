"""Bounded pipeline work (proxy.work): the file-aware rules linear in the history
(operation counts, never a clock), the work budget's degradation (stage-1 forms, the prefix
kept across requests), and a disconnected client's work stopped."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy.conversation
from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.config.offload import OffloadConfig
from proxy.config.retrieval import RetrievalConfig
from proxy.demo.fake.upstream import FakeUpstream
from proxy.filewise import dedupe, rereads
from proxy.filewise.provenance import provenance
from proxy.model import RequestView, result_text
from proxy.offload.stage import Offloader
from proxy.session import Identity
from proxy.store.chains import chain_hashes
from proxy.work import Cancelled, Work

from .conftest import examples, proxy_config
from .test_filewise import _kind, session

IDENT = Identity("t", "s", None)


def rereading(reads: int, lines: int = 30, files: int = 8) -> list[dict[str, Any]]:
    """A session reading ``files`` files in turn, ``reads`` reads in all; every third round
    shows one line changed (deltas), the others the same text (unchanged markers)."""
    texts = ["".join(f"line {j} of file {i}: value = {i * j}\n" for j in range(lines))
             for i in range(files)]
    history: list[dict[str, Any]] = [{"role": "system", "content": "agent"},
                                     {"role": "user", "content": "read it all"}]
    for k in range(reads):
        i = k % files
        text = texts[i]
        if (k // files) % 3 == 1:
            text = text.replace("line 7 ", f"line 7 (changed {k}) ", 1)
        history += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"c{k}", "type": "function", "function": {
                    "name": "read_file",
                    "arguments": orjson.dumps({"path": f"/repo/m{i}.py"}).decode()}}]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": text},
        ]
    return history


def view(history: list[dict[str, Any]], work: Work | None = None) -> RequestView:
    return RequestView(model="gpt-4o", body={"messages": history}, identity=IDENT,
                       chains=chain_hashes(history), history=history, work=work)


def offloader(tmp: Path, **config: Any) -> Offloader:
    return Offloader(OffloadConfig(dedupe_min_bytes=1024, **config), RetrievalConfig(), tmp)


@pytest.fixture
def same_file_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How often the re-read rules compare two paths (their inner loop)."""
    calls = [0]
    real = rereads.same_file

    def counting(a: str, b: str) -> bool:
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(rereads, "same_file", counting)
    yield calls


@pytest.fixture
def hashed_bytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The bytes dedupe splits and hashes into lines (its per-output work)."""
    hashed = [0]
    real = dedupe._Lines

    class Counting(real):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def __init__(self, data: bytes) -> None:
            hashed[0] += len(data)
            super().__init__(data)

    monkeypatch.setattr(dedupe, "_Lines", Counting)
    yield hashed


def test_rereads_and_superseded_reads_are_linear_in_the_reads(
    tmp_path: Path, same_file_calls: list[int]
) -> None:
    """The fuzz-found case: re-reading 8 files over and over. Each re-read looked at every
    earlier read of its file (for its base) and at an epoch every later one (superseded):
    quadratic. Twice the reads: about twice the comparisons."""
    counts = []
    for reads in (400, 800):
        history = rereading(reads)
        same_file_calls[0] = 0
        kinds = set()
        # Arriving in the epoch (deltas), then all before an epoch's start (markers).
        for seen in (0, len(history) - 2):
            out = offloader(tmp_path / f"{reads}-{seen}").run(
                history, view(history), aged_turns=0, seen=seen)
            kinds |= {_kind(result_text(m.get("content")) or "") for m in out.messages}
        assert {"marker", "delta"} <= kinds  # the rules ran
        counts.append(same_file_calls[0])
    assert counts[1] <= 2.5 * counts[0], counts


def test_dedupe_hashes_each_earlier_output_once(tmp_path: Path, hashed_bytes: list[int]) -> None:
    """Outputs that share a line (a header) but no repeat: each new output used to hash
    every earlier one again (up to 4 MiB of them): quadratic in the outputs."""
    counts = []
    for runs in (150, 300):
        history: list[dict[str, Any]] = [{"role": "user", "content": "run them"}]
        for k in range(runs):
            out = "=== test session starts ===\n" + "".join(
                f"run {k} case {j}: ok {k * 1000 + j}\n" for j in range(60))
            history += [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"c{k}", "type": "function",
                    "function": {"name": "bash", "arguments": '{"cmd": "make test"}'}}]},
                {"role": "tool", "tool_call_id": f"c{k}", "content": out}]
        hashed_bytes[0] = 0
        offloader(tmp_path / str(runs)).run(history, view(history), aged_turns=0)
        counts.append(hashed_bytes[0])
    assert counts[0] > 0
    assert counts[1] <= 2.5 * counts[0], counts


class CountingCalls(list[Any]):
    """A message's ``tool_calls`` that counts the calls it hands out when iterated."""

    handed = 0

    def __iter__(self) -> Iterator[Any]:
        for call in super().__iter__():
            CountingCalls.handed += 1
            yield call


def test_one_message_with_many_calls_is_linear(tmp_path: Path) -> None:
    """One assistant message with 20,000 calls took 7 s: each read looked its call up among
    all the message's calls. Twice the calls: about twice the calls visited."""
    counts = []
    for n in (1000, 2000):
        calls = CountingCalls({"id": f"c{k}", "type": "function", "function": {
            "name": "read_file", "arguments": orjson.dumps({"path": f"/r/f{k % 50}.py"}).decode()}}
            for k in range(n))
        history: list[dict[str, Any]] = [{"role": "user", "content": "go"},
                                         {"role": "assistant", "content": None,
                                          "tool_calls": calls}]
        history += [{"role": "tool", "tool_call_id": f"c{k}",
                     "content": f"contents of f{k % 50}\n" * 40} for k in range(n)]
        CountingCalls.handed = 0
        offloader(tmp_path / str(n)).run(history, view(history), aged_turns=0,
                                          seen=len(history))
        counts.append(CountingCalls.handed)
    assert counts[1] <= 2.5 * counts[0], counts


# -- the budget ----------------------------------------------------------------------------


def _forward(off: Offloader, history: list[dict[str, Any]], budget: int) -> tuple[Any, Work]:
    work = Work(budget)
    return off.run(history, view(history, work), aged_turns=0, seen=0), work


def test_a_spent_budget_gives_stage_one_forms_and_keeps_the_prefix(tmp_path: Path) -> None:
    full = rereading(120)
    first = full[: len(full) // 2]
    # Each decision counts its result and its base (~1,700 characters): enough for the first
    # ~35 reads' decisions (the unchanged re-reads of the fourth round among them), not the
    # rest of either request.
    budget = 60_000
    off = offloader(tmp_path / "a")
    one, work_one = _forward(off, first, budget)
    two, work_two = _forward(off, full, budget)
    assert work_one.degraded == ["filewise"] and work_two.degraded == ["filewise"]
    # Append-only: the second request starts with the first one as forwarded.
    assert two.messages[: len(first)] == one.messages
    kinds = [_kind(result_text(m.get("content")) or "") for m in two.messages]
    decided = [i for i, k in enumerate(kinds) if k is not None]
    assert decided and max(decided) < len(full) // 2  # the rules stopped at the budget
    assert kinds[-1] is None  # ... and stayed stopped for the rest of the epoch
    # A process that lost its decisions (a restart, another replica) forwards the same.
    again, _ = _forward(offloader(tmp_path / "b"), full, budget)
    assert again.messages == two.messages
    # A budget the epoch's decisions fit in: the rules decide every result.
    whole, work = _forward(offloader(tmp_path / "c"), full, 10**9)
    assert not work.degraded
    assert any(_kind(result_text(m.get("content")) or "") is not None
               for m in whole.messages[len(full) // 2:])


def test_a_zero_budget_forwards_what_the_rules_off_forward(tmp_path: Path) -> None:
    history = rereading(64)
    degraded, work = _forward(offloader(tmp_path / "a"), history, 0)
    off = offloader(tmp_path / "b", reread_deltas=False, supersede_reads=False, dedupe=False)
    plain = off.run(history, view(history), aged_turns=0, seen=0)
    assert work.degraded == ["filewise"]
    assert degraded.messages == plain.messages
    assert not any(k.startswith("files_") for k in degraded.stats)


async def test_the_budget_degrades_a_request_end_to_end(tmp_path: Path) -> None:
    fake = FakeUpstream()
    from proxy.demo.servers import serve_in_thread

    with serve_in_thread(fake) as upstream:
        config = proxy_config(upstream.url + "/v1", tmp_path / "data",
                              {"server": {"pipeline_budget": 0}})
        async with InProcess(create_app(config)) as app:
            body = {"model": "gpt-4o", "messages": rereading(40)}
            r = await app.client.post("/v1/chat/completions", json=body,
                                      headers={"x-session-id": "budget"})
            assert r.status_code == 200
            assert r.headers["x-ctxproxy-degraded"] == "1"
            assert int(r.headers["x-ctxproxy-work"]) > 0
            metrics = (await app.client.get("/metrics")).text
            assert "ctxproxy_pipeline_degraded_total 1.0" in metrics
            sent = fake.received[-1].json()["messages"]
            assert all(_kind(result_text(m.get("content")) or "") is None for m in sent)


# -- cancellation --------------------------------------------------------------------------


async def test_a_disconnected_clients_pipeline_work_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client goes away while its (large: worker-thread) pipeline runs: the pipeline
    stops at its next unit of work, nothing is forwarded, and it is counted."""
    loop = asyncio.get_running_loop()
    started = asyncio.Event()
    made: list[Work] = []
    after_cancel: list[int] = []

    class Watched(Work):
        __slots__ = ()

        def spend(self, units: int) -> None:
            if not made or made[0] is not self:
                made.insert(0, self)
            after_cancel.append(units)  # every unit spent, from the first
            if not started.is_set():
                # The first unit of work: the client leaves now; this worker thread waits
                # until the event loop has told the work (the disconnect watch).
                loop.call_soon_threadsafe(started.set)
                assert self._cancelled.wait(30)
            super().spend(units)

    monkeypatch.setattr(proxy.conversation, "Work", Watched)
    fake = FakeUpstream()
    from proxy.demo.servers import serve_in_thread

    with serve_in_thread(fake) as upstream:
        config = proxy_config(upstream.url + "/v1", tmp_path / "data")
        async with InProcess(create_app(config)) as app:
            history = rereading(400)  # ~500 KB: the pipeline runs in a worker thread
            raw = orjson.dumps({"model": "gpt-4o", "messages": history})
            sent: list[dict[str, Any]] = []
            delivered = False

            async def receive() -> dict[str, Any]:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": raw, "more_body": False}
                await started.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                     "raw_path": b"/v1/chat/completions", "query_string": b"",
                     "root_path": "", "server": ("testserver", 80),
                     "client": ("127.0.0.1", 1), "state": dict(app.state),
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(raw)).encode()),
                                 (b"x-session-id", b"gone")]}
            await create_app_call(app, scope, receive, send)
            assert made and made[0].cancelled
            # The first unit (during which the client left) found the flag set: no other ran.
            assert len(after_cancel) == 1
            assert not any(m["type"] == "http.response.start" for m in sent)
            assert not fake.received  # nothing was forwarded
            metrics = (await app.client.get("/metrics")).text
            assert "ctxproxy_pipeline_cancelled_total 1.0" in metrics
            await app.drain()
            staging = tmp_path / "data" / "_staging"
            assert not staging.exists() or not any(staging.iterdir())


async def create_app_call(app: InProcess, scope: dict[str, Any], receive: Any,
                          send: Any) -> None:
    """Call the app as a server does, in a task of its own."""
    await asyncio.ensure_future(app.app(scope, receive, send))


def test_cancelled_is_not_an_exception_a_stage_swallows() -> None:
    work = Work()
    work.cancel()
    with pytest.raises(Cancelled):
        try:
            work.spend(1)
        except Exception:  # what the runner's stage guard catches
            pytest.fail("Cancelled was caught as an Exception")
    assert threading.current_thread() is threading.main_thread()


# -- the caches' bounds ----------------------------------------------------------------------


def test_the_content_caches_add_up_to_cache_mb() -> None:
    from proxy.services import cache_split

    for mb in (8, 32, 512):
        split = cache_split(mb * 1024 * 1024)
        assert sum(split.values()) <= mb * 1024 * 1024
        assert set(split) == {"tokens", "cuts", "digests", "rounds", "memos"}


def _pinned(cache: Any) -> int:
    """The characters of the keys a cache of calls pins (their arguments)."""
    return sum(len(k[1]) for k, _ in cache.items())


def test_parsed_calls_and_policies_are_bounded_by_what_they_pin() -> None:
    """A Write call's arguments hold a whole file: 65,536 of them was the old bound."""
    from proxy.config.offload import OffloadConfig
    from proxy.filewise.provenance import CallCache
    from proxy.offload.policies import Policies

    budget = 1024 * 1024
    calls = CallCache({}, budget)
    policies = Policies(OffloadConfig().policies, cache_bytes=budget)
    for k in range(64):
        args = orjson.dumps({"file_path": f"/r/f{k}.py", "content": f"{k}" * 100_000}).decode()
        calls.files("Write", args, f"c{k}", 1)
        policies.of_call("Write", args)
    assert 0 < _pinned(calls._parsed) <= budget
    assert 0 < _pinned(policies._calls) <= budget


def test_the_epochs_decisions_are_bounded_by_what_they_pin(tmp_path: Path) -> None:
    from proxy.filewise.plan import FileForms

    off = offloader(tmp_path)
    off.filewise = FileForms(off.config, cache_bytes=3 * 64 * 1024)
    for s in range(40):  # forty sessions, each an epoch of decided results
        history = rereading(40)
        ident = Identity("t", f"s{s}", None)
        req = RequestView(model="gpt-4o", body={"messages": history}, identity=ident,
                          chains=chain_hashes(history), history=history)
        off.run(history, req, aged_turns=0, seen=0)
    epochs = off.filewise._epochs
    assert 0 < len(epochs) < 40
    assert epochs.size <= 64 * 1024


def test_the_epochs_superseded_reads_are_found_once_a_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Marks too large for their cache were found again for every result (12 MB of re-reads
    took 60 s, 6 MB 5 s): once a request, whatever the cache keeps."""
    from proxy.filewise import plan as filewise

    calls = [0]
    real = filewise.superseded

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(filewise, "superseded", counting)
    off = offloader(tmp_path)
    off.filewise = filewise.FileForms(off.config, cache_bytes=3 * 1024)  # keeps no marks
    history = rereading(200)
    out = off.run(history, view(history), aged_turns=0, seen=len(history) - 2)
    assert any(_kind(result_text(m.get("content")) or "") == "marker" for m in out.messages)
    assert calls[0] == 1


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 10**6), st.integers(4, 40), st.data())
def test_the_reread_index_answers_as_reread(seed: int, steps: int, data: st.DataObject) -> None:
    """Rereads (an index, O(log n) a result) against reread() (a pass over every read), on
    generated coding sessions with results found whole at random."""
    history = session(seed, steps)
    prov = provenance(history, {})
    index = rereads.Rereads(history, prov, rereads.turns_upto(history, len(history)))
    whole: set[int] = set()
    for i, m in enumerate(history):
        if m.get("role") != "tool":
            continue
        expected = rereads.reread(history, prov, i, forwarded_whole=lambda j: j in whole)
        assert index.find(i) == expected
        if data.draw(st.booleans()):
            whole.add(i)
            index.whole(i)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d", "e" * 40, "f" * 80]), min_size=1,
                max_size=60), st.integers(1, 8), st.integers(0, 6))
def test_the_dedup_index_answers_as_duplicate(
    lines: list[str], outputs: int, calls: int
) -> None:
    """DedupIndex (each earlier output hashed once) against duplicate() (all hashed per
    call), outputs made of repeated lines, some sharing a call id."""
    texts = ["".join(f"{line} {k % 3}\n" for k, line in enumerate(lines[n:] + lines[:n]))
             for n in range(outputs)]
    earlier: list[dedupe.Earlier] = []
    index = dedupe.DedupIndex(min_bytes=64, budget_bytes=2048)
    for n, text in enumerate(texts):
        expected = dedupe.duplicate(text, earlier, min_bytes=64, budget_bytes=2048)
        assert index.duplicate(text) == expected
        e = dedupe.Earlier(n, f"c{n % (calls + 1)}", n + 1, text)
        earlier.append(e)
        index.add(e)
