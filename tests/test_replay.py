"""The proxy's own read rounds are put back into later turns' forwarded history (proxy.retrieval.rounds,
proxy.retrieval.replay), in every wire format: before the answer they led to, byte for byte as
the loop forwarded them; the model's whole answer and the proxy's results when the client's
copy lost the proxy's calls; nothing for an edited history or an answer a compaction evicted;
and no store query for a history this process answered (the files backend here; PostgreSQL
and two replicas in test_replay_postgres)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from harness.inprocess import InProcess
from proxy import rawjson as wire_json
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.formats import Format
from proxy.formats.chat.request import CHAT
from proxy.formats.messages.request import MESSAGES
from proxy.formats.responses.request import RESPONSES
from proxy.pipeline.validate import PLACEHOLDER
from proxy.retrieval.rounds import Replays
from proxy.store.db import Database
from proxy.store.rounds import RoundsRecord, SqliteRounds

from . import test_messages as msgs
from . import test_responses as resp
from . import test_retrieval as chat
from .conftest import InProcessFactory

READ = "read_offloaded"


@dataclass(frozen=True)
class Wire:
    """One wire format as the tests drive it."""

    fmt: Format
    path: str
    array: str  # the member holding the conversation
    client_tool: str
    headers: dict[str, str]

    def body(self, items: list[Any], stream: bool) -> dict[str, Any]:
        if self.fmt is CHAT:
            out: dict[str, Any] = {"model": "gpt-4o", "messages": items}
        elif self.fmt is RESPONSES:
            out = resp.body(items)
        else:
            out = msgs.body(items)
        return {**out, "stream": True} if stream else out

    def history(self) -> list[Any]:
        if self.fmt is CHAT:
            return chat.history(chat.big_output())
        if self.fmt is RESPONSES:
            return resp.reading_input()
        return msgs.reading_messages()

    def user(self, text: str) -> dict[str, Any]:
        if self.fmt is CHAT:
            return {"role": "user", "content": text}
        return resp.user(text) if self.fmt is RESPONSES else msgs.user(text)

    def answer_items(self, answer: Any) -> list[Any]:
        return list(answer) if isinstance(answer, list) else [answer]

    def results(self, answer: Any) -> list[Any]:
        """The client's results for its calls in the answer."""
        if self.fmt is CHAT:
            return [{"role": "tool", "tool_call_id": c["id"], "content": "client result"}
                    for c in answer.get("tool_calls") or []]
        if self.fmt is RESPONSES:
            return [{"type": "function_call_output", "call_id": i["call_id"],
                     "output": "client result"}
                    for i in answer if i.get("type") == "function_call"]
        blocks = [{"type": "tool_result", "tool_use_id": b["id"], "content": "client result"}
                  for b in answer["content"] if b.get("type") == "tool_use"]
        return [{"role": "user", "content": [*blocks, {"type": "text", "text": "go on"}]}]


WIRES = {
    "chat": Wire(CHAT, "/v1/chat/completions", "messages", "bash",
                 {"authorization": "Bearer sk-r"}),
    "responses": Wire(RESPONSES, "/v1/responses", "input", "exec_command",
                      {"authorization": "Bearer sk-r"}),
    "messages": Wire(MESSAGES, "/v1/messages", "messages", "Bash",
                     {"x-api-key": "sk-ant-r", "anthropic-version": "2023-06-01"}),
}


class Model:
    """Reads once (``reads`` times) when told to, the client's tool called too when
    ``mixed``; otherwise answers. Summarizer requests get a summary."""

    def __init__(self, fake: FakeUpstream, wire: Wire) -> None:
        self.wire = wire
        self.reads = 0
        self.mixed = False
        fake.responder = self

    def __call__(self, req: dict[str, Any]) -> Reply:
        from .test_compaction import SUMMARY, is_summarizer

        if "messages" in req and self.wire.fmt is CHAT and is_summarizer(req):
            return Reply(content=SUMMARY)
        if self.reads > 0:
            self.reads -= 1
            calls = [{"name": READ, "id": f"read_{self.reads}",
                      "arguments": {"file_path": "tool_result/none.txt"}}]
            if self.mixed:
                calls.append({"name": self.wire.client_tool, "id": "mine_1",
                              "arguments": {"command": "ls"}})
            return Reply(content=None, reasoning="I should read it", tool_calls=calls)
        return Reply(content="Done.", reasoning="all read")


def client_copy(wire: Wire, body: bytes, stream: bool) -> Any:
    """The answer as the client got it (assembled as the proxy's tap does)."""
    tap = wire.fmt.tap()
    if stream:
        tap.stream(body)
    else:
        tap.whole(body)
    return tap.answer()


async def post(app: InProcess, wire: Wire, items: list[Any], session: str,
               stream: bool = False) -> Any:
    r = await app.client.post(wire.path, content=orjson.dumps(wire.body(items, stream)),
                              headers={**wire.headers, "x-ctxproxy-session": session})
    assert r.status_code == 200, r.text
    return r


def items_of(wire: Wire, raw: bytes) -> list[bytes]:
    return [bytes(i) for i in wire_json.array_items(wire_json.members(raw)[wire.array])]


@pytest.fixture(params=sorted(WIRES))
def wire(request: pytest.FixtureRequest) -> Wire:
    return WIRES[request.param]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_round_goes_back_before_the_answer_as_the_loop_sent_it(
    make_inproc: InProcessFactory, fake: FakeUpstream, wire: Wire, stream: bool
) -> None:
    model = Model(fake, wire)
    app = await make_inproc()
    history = wire.history()
    model.reads = 1
    r = await post(app, wire, history, "s1", stream)
    assert fake.request_count == 2  # one read round, then the answer
    first, again = (items_of(wire, fake.received[i].body) for i in (0, 1))
    internal = again[len(first):]
    assert len(internal) == (3 if wire.fmt is RESPONSES else 2)  # [reasoning,] call, result
    answer = client_copy(wire, r.content, stream)
    followup = wire.user("and now?")
    await post(app, wire, [*history, *wire.answer_items(answer), followup], "s1", stream)
    assert fake.request_count == 3
    sent = items_of(wire, fake.received[-1].body)
    n = len(first)
    assert sent[:n] == first  # the client's history as before
    assert sent[n:n + len(internal)] == internal  # the round, byte for byte
    copy = [orjson.loads(i) for i in sent[n + len(internal):-1]]
    assert copy == wire.answer_items(answer)  # then the answer as the client has it
    assert orjson.loads(sent[-1]) == followup
    if wire.fmt is MESSAGES:
        thinking = orjson.loads(internal[0])["content"][0]
        assert thinking["type"] == "thinking" and thinking["signature"]
    # The tools are the same as in the loop's rounds (the replayed call's tool stays defined).
    assert fake.received[-1].json()["tools"] == fake.received[0].json()["tools"]


async def test_an_answer_with_the_clients_calls_too_comes_back_whole(
    make_inproc: InProcessFactory, fake: FakeUpstream, wire: Wire
) -> None:
    model = Model(fake, wire)
    app = await make_inproc()
    history = wire.history()
    model.reads, model.mixed = 1, True
    r = await post(app, wire, history, "s1")
    assert fake.request_count == 1  # no further round: the client has calls to run
    answer = client_copy(wire, r.content, False)
    copy = wire.answer_items(answer)
    assert READ not in orjson.dumps(copy).decode()  # the client never sees the proxy's call
    first = items_of(wire, fake.received[0].body)
    results = wire.results(answer)
    await post(app, wire, [*history, *copy, *results], "s1")
    sent = [orjson.loads(i) for i in items_of(wire, fake.received[-1].body)]
    rest = sent[len(first):]
    assert PLACEHOLDER not in orjson.dumps(rest).decode()
    if wire.fmt is CHAT:
        full, ours, theirs = rest
        assert [c["function"]["name"] for c in full["tool_calls"]] == [READ, "bash"]
        assert ours["tool_call_id"] == "read_0" and ours["content"].startswith("error:")
        assert theirs == results[0]
    elif wire.fmt is RESPONSES:
        kinds = [(i["type"], i.get("name") or i.get("call_id")) for i in rest]
        assert kinds == [("reasoning", None), ("function_call", READ),
                         ("function_call", "exec_command"), ("function_call_output", "read_0"),
                         ("function_call_output", "mine_1")]
    else:
        full, user = rest
        assert [(b["type"], b.get("name")) for b in full["content"]] == [
            ("thinking", None), ("tool_use", READ), ("tool_use", "Bash")]
        assert full["content"][0]["signature"] == answer["content"][0]["signature"]
        # The proxy's result first, then the client's own results and text.
        assert [(b["type"], b.get("tool_use_id")) for b in user["content"]] == [
            ("tool_result", "read_0"), ("tool_result", "mine_1"), ("text", None)]
        assert user["content"][1:] == results[0]["content"]


async def test_an_edited_history_gets_nothing(
    make_inproc: InProcessFactory, fake: FakeUpstream, wire: Wire
) -> None:
    model = Model(fake, wire)
    app = await make_inproc()
    history = wire.history()
    model.reads = 1
    r = await post(app, wire, history, "s1")
    answer = wire.answer_items(client_copy(wire, r.content, False))
    first = items_of(wire, fake.received[0].body)
    # The client edited its earlier message: the answer follows another prefix now.
    edited = [*history[:-1], wire.user("what is on line 1400?"), *answer, wire.user("and?")]
    await post(app, wire, edited, "s1")
    assert len(items_of(wire, fake.received[-1].body)) == len(first) + len(answer) + 1
    # And an answer the client changed is not the one the rounds led to.
    changed = orjson.loads(orjson.dumps(answer).replace(b"Done.", b"Done!"))
    await post(app, wire, [*history, *changed, wire.user("and?")], "s1")
    assert len(items_of(wire, fake.received[-1].body)) == len(first) + len(answer) + 1
    # The answer as it was gets them.
    await post(app, wire, [*history, *answer, wire.user("and?")], "s1")
    assert len(items_of(wire, fake.received[-1].body)) > len(first) + len(answer) + 1


async def test_the_inserted_messages_are_counted(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    wire = WIRES["messages"]
    model = Model(fake, wire)
    app = await make_inproc()
    history = wire.history()
    model.reads = 1
    r = await post(app, wire, history, "s1")
    turn2 = [*history, *wire.answer_items(client_copy(wire, r.content, False)), wire.user("?")]
    replayed = await post(app, wire, turn2, "s1")
    plain = await post(app, wire, turn2, "s2")  # another session: no rounds of its own
    assert len(fake.received[-2].body) > len(fake.received[-1].body)
    tokens = [int(x.headers["x-ctxproxy-tokens-out"]) for x in (replayed, plain)]
    assert tokens[0] > tokens[1]


async def test_an_answer_a_compaction_evicted_has_no_rounds_put_back(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    wire = WIRES["chat"]
    model = Model(fake, wire)
    app = await make_inproc({"compaction": {"context_windows": {"gpt-4o": 16000}}})
    history = wire.history()
    model.reads = 1
    r = await post(app, wire, history, "s1")
    answer = client_copy(wire, r.content, False)
    later: list[Any] = [answer]
    for n in range(10):
        later += [{"role": "user", "content": f"step {n}: " + "word " * 1500},
                  {"role": "assistant", "content": f"did {n}"}]
    with app.state["services"].replays.store.db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM rounds WHERE session = 's1'").fetchone()[0] == 1
    r2 = await post(app, wire, [*history, *later, wire.user("and?")], "s1")
    assert r2.headers["x-ctxproxy-compacted"] == "1"
    sent = fake.received[-1].json()["messages"]
    assert not any(c["function"]["name"] == READ for m in sent for c in m.get("tool_calls") or [])
    assert not any(m.get("role") == "tool" for m in sent)
    assert not any(m.get("content") == "Done." for m in sent)  # the answer was evicted


class CountingRounds(SqliteRounds):
    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.finds: list[list[str]] = []

    def find(self, tenant: str, session: str, chains: Sequence[str]) -> list[RoundsRecord]:
        self.finds.append(list(chains))
        return super().find(tenant, session, chains)


async def test_a_resent_history_asks_the_store_nothing(
    make_inproc: InProcessFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    """Answers this process returned are known (rounds or none); only an assistant message
    it never saw costs one lookup, once."""
    wire = WIRES["chat"]
    model = Model(fake, wire)
    app = await make_inproc()
    replays: Replays = app.state["services"].replays
    assert replays.store is not None
    store = CountingRounds(replays.store.db)  # type: ignore[attr-defined]
    replays.store = store
    items = wire.history()
    for turn in range(3):
        model.reads = 1 if turn == 1 else 0
        r = await post(app, wire, items, "s1")
        items = [*items, client_copy(wire, r.content, False), wire.user(f"turn {turn}")]
    # Once, on the first turn, for the assistant message the client brought along; never
    # for an answer this process returned.
    assert [len(f) for f in store.finds] == [1]
    fresh = Replays(store)  # another replica's (or a restarted process's) cache
    replays._known = fresh._known
    await post(app, wire, items, "s1")
    assert [len(f) for f in store.finds] == [1, 4]  # that one and the three answers, at once
    sent = fake.received[-1].json()["messages"]
    assert sum(1 for m in sent if m.get("role") == "tool") == 2  # the client's, and the read
    await post(app, wire, items, "s1")
    assert len(store.finds) == 2


def test_the_sqlite_store_keeps_the_bytes_and_the_first_record(tmp_path: Path) -> None:
    with Database(tmp_path / "db.sqlite3") as db:
        store = SqliteRounds(db)
        rec = RoundsRecord("t", "s", "c" * 32, "b" * 32, "messages",
                           before=(b'{"role":"assistant","content":[ {"x":1.50} ]}',),
                           answer=None, after=())
        store.put(rec)
        store.put(RoundsRecord("t", "s", "c" * 32, "", "chat", before=(b"{}",), answer=(b"{}",)))
        [got] = store.find("t", "s", ["c" * 32, "d" * 32])
        assert (got.before, got.answer, got.after, got.parent, got.api) == (
            rec.before, None, (), rec.parent, "messages")
        assert store.find("t", "other", ["c" * 32]) == []


def test_a_database_from_before_gains_the_table(tmp_path: Path) -> None:
    import sqlite3

    from proxy.store.migrations import MIGRATIONS, SCHEMA_VERSION

    rounds_version = 5  # the version that added the table
    assert any("CREATE TABLE rounds" in s for s in MIGRATIONS[rounds_version - 1])
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in (s for step in MIGRATIONS[:rounds_version - 1] for s in step):
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version={rounds_version - 1}")
    conn.close()
    with Database(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        store = SqliteRounds(db)
        store.put(RoundsRecord("t", "s", "c" * 32, "", "chat", before=(b"{}",), answer=None))
        assert len(store.find("t", "s", ["c" * 32])) == 1


def test_a_message_is_recognised_whatever_markers_or_nulls_it_carries() -> None:
    from proxy.retrieval.replay import Replayed, insert, key

    plain = {"role": "user", "content": [{"type": "text", "text": "go"}]}
    marked = {"role": "user", "content": [{"type": "text", "text": "go",
                                           "cache_control": {"type": "ephemeral"}}]}
    assert key(plain) == key(marked) == key({**plain, "name": None})
    assert key(plain) != key({"role": "user", "content": [{"type": "text", "text": "go!"}]})
    # Put in place before the answer found; the client's other messages are the same objects.
    answer = {"role": "assistant", "content": "done"}
    history = [plain, answer]
    read = ({"role": "assistant", "content": "", "tool_calls": [
        {"id": "r", "type": "function", "function": {"name": READ, "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "r", "content": "text"})
    out = insert(list(history), history, {1: Replayed(key(plain), read, None)})
    assert out.messages == [plain, *read, answer] and out.messages[0] is plain
    assert out.stats == {"replayed": 2}
