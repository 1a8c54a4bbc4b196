"""File-aware slimming in the offload stage (proxy.filewise.plan): hypothesis-generated
coding sessions (Claude Code's Read / Edit / Bash shapes, its reminders around each result)
grown turn by turn across epochs, checked for the issue's properties: deterministic;
append-only within an epoch; at an epoch's start the newest read of each file and every read a
later edit quotes verbatim; every original recoverable byte for byte."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config.offload import OffloadConfig
from proxy.config.retrieval import RetrievalConfig
from proxy.filewise.dedupe import Earlier, expand
from proxy.filewise.delta import apply_delta, parse_delta
from proxy.filewise.envelope import split_envelope
from proxy.filewise.plan import plain_lines
from proxy.filewise.rereads import parse_marker, turn_of
from proxy.model import RequestView, result_text
from proxy.offload.stage import Offloader
from proxy.session import Identity
from proxy.store.chains import chain_hashes

from .conftest import examples

IDENT = Identity("t", "s", None)
REMINDER = "\n\n<system-reminder>\n<total_tokens>{n} tokens left</total_tokens>\n</system-reminder>"


class Repo:
    """Files of numbered lines, read and edited as Claude Code does."""

    def __init__(self, rnd: random.Random, files: int) -> None:
        self.files = {f"/repo/src/m{k}.py": [f"def f{k}_{i}(x): return x + {i}  # {rnd.random()}"
                                            for i in range(rnd.randint(30, 120))]
                      for k in range(files)}
        self.tick = 0

    def read(self, path: str, offset: int | None, limit: int | None) -> str:
        lines = self.files[path]
        start = offset or 1
        end = len(lines) if limit is None else min(len(lines), start + limit - 1)
        self.tick += 1
        body = "".join(f"{n}\t{lines[n - 1]}\n" for n in range(start, end + 1))
        return body + REMINDER.format(n=10**6 - self.tick)


def session(seed: int, steps: int) -> list[dict[str, Any]]:
    """A chat-shaped agent history: reads (whole, ranges, re-reads), edits quoting what was
    read, a repeated command's output."""
    rnd = random.Random(seed)
    repo = Repo(rnd, 3)
    history: list[dict[str, Any]] = [{"role": "system", "content": "agent"},
                                     {"role": "user", "content": "fix it"}]
    log = "".join(f"tests/test_{k}.py::test_{j} PASSED\n" for k in range(8) for j in range(40))
    for n in range(steps):
        cid = f"c{n}"
        path = rnd.choice(sorted(repo.files))
        kind = rnd.choice(["read", "read", "range", "edit", "bash"])
        if kind == "edit":
            k = rnd.randrange(len(repo.files[path]))
            old = repo.files[path][k]
            new = old.replace("return x", f"return -x*{n}")
            args: dict[str, Any] = {"file_path": path, "old_string": old, "new_string": new}
            repo.files[path][k] = new
            name, out = "Edit", f"The file {path} has been updated successfully."
        elif kind == "bash":
            name, args = "Bash", {"command": "pytest -q"}
            out = log + f"=== {rnd.randint(1, 3)} failed ===\n"
        else:
            offset = rnd.randint(1, 20) if kind == "range" else None
            limit = rnd.randint(10, 40) if kind == "range" else None
            args = {"file_path": path, **({"offset": offset, "limit": limit} if offset else {})}
            name, out = "Read", repo.read(path, offset, limit)
        history.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function",
             "function": {"name": name, "arguments": orjson.dumps(args).decode()}}]})
        history.append({"role": "tool", "tool_call_id": cid, "content": out})
    return history


def offloader(tmp: Path) -> Offloader:
    return Offloader(OffloadConfig(dedupe_min_bytes=1024), RetrievalConfig(), tmp)


def view(history: list[dict[str, Any]]) -> RequestView:
    return RequestView(model="gpt-4o", body={"messages": history}, identity=IDENT,
                       chains=chain_hashes(history), history=history)


def forward(off: Offloader, history: list[dict[str, Any]], seen: int) -> Any:
    return off.run(history, view(history), aged_turns=0, seen=seen)


def _kind(text: str) -> str | None:
    if parse_marker(text) is not None:
        return "marker"
    body = split_envelope(text).body
    if parse_delta(body) is not None:
        return "delta"
    if "[ctxproxy: " in body:
        return "reference"
    return None


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(0, 10**6), st.integers(8, 30), st.data())
def test_the_file_aware_forms_keep_their_promises(
    tmp_path_factory: Any, seed: int, steps: int, data: st.DataObject
) -> None:
    full = session(seed, steps)
    off = offloader(tmp_path_factory.mktemp("fw"))
    # Requests grow a turn (two messages) at a time; an epoch starts at a few of them.
    ends = list(range(4, len(full) + 1, 2))
    starts = sorted(data.draw(st.sets(st.sampled_from(ends), max_size=3)))
    seen = 0
    previous: list[dict[str, Any]] | None = None
    originals: dict[str, str] = {}
    for end in ends:
        history = full[:end]
        epoch_start = end in starts
        if epoch_start:
            seen = end
        out = forward(off, history, seen)
        again = forward(offloader(tmp_path_factory.mktemp("fw")), history, seen)
        assert again.messages == out.messages  # deterministic, whatever the caches hold
        for f in out.files:
            originals[f.rid] = f.text
            assert f.text == result_text(history[f.index]["content"])  # kept whole
        if previous is not None and not epoch_start:
            # Append-only within an epoch: what went out before goes out again, byte for byte.
            assert out.messages[: len(previous)] == previous
        if epoch_start:
            newest: dict[str, int] = {}
            for i, m in enumerate(history):
                if m["role"] == "assistant":
                    fn = m["tool_calls"][0]["function"]
                    if fn["name"] == "Read":
                        newest[orjson.loads(fn["arguments"])["file_path"]] = i + 1
            for path, i in newest.items():
                assert _kind(out.messages[i]["content"]) is None, f"newest read of {path}"
            quoted = [orjson.loads(m["tool_calls"][0]["function"]["arguments"])["old_string"]
                      for m in history if m["role"] == "assistant"
                      and m["tool_calls"][0]["function"]["name"] == "Edit"]
            for i, m in enumerate(history):
                body = split_envelope(m["content"] or "").body if m["role"] == "tool" else ""
                plain = plain_lines(body)
                text = plain[1] if plain else body
                if any(q in text for q in quoted) and _kind(out.messages[i]["content"]) == "marker":
                    # Only an edit *later* than the read protects it.
                    call = history[i - 1]["tool_calls"][0]["id"]
                    later = [h for h in history[i:] if h["role"] == "assistant"
                             and h["tool_calls"][0]["function"]["name"] == "Edit"
                             and orjson.loads(h["tool_calls"][0]["function"]["arguments"])
                             ["old_string"] in text]
                    assert not later, f"a read a later edit quotes was marked ({call})"
        # Every form can be undone: deltas against their base, references from their sources.
        whole = {i: split_envelope(m["content"]).body for i, m in enumerate(history)
                 if m["role"] == "tool" and out.messages[i]["content"] == m["content"]}
        for i, m in enumerate(out.messages):
            if m["role"] != "tool" or m["content"] == history[i]["content"]:
                continue
            kind = _kind(m["content"])
            # Each form names where its original is kept, and it is kept there, whole.
            rid = m["content"].split("tool_result/", 1)[1].split(".txt", 1)[0]
            assert originals.get(rid) == result_text(history[i]["content"])
            if kind not in ("delta", "reference"):
                continue  # a marker replaces the whole result
            envelope = split_envelope(history[i]["content"])
            mine = envelope.body
            # The form, inside the result's own envelope.
            got = m["content"][len(envelope.head): len(m["content"]) - len(envelope.tail)]
            assert envelope.wrap(got) == m["content"]
            if kind == "delta":
                bases = [b for b in whole.values() if _applies(b, got, mine)]
                assert bases, f"result {i}: the delta applies to no base forwarded whole"
            elif kind == "reference":
                refs = [Earlier(j, history[j]["tool_call_id"], turn_of(history, j), b)
                        for j, b in whole.items() if j < i]
                assert _expands(got, refs, mine), f"result {i}: references do not expand"
        previous = out.messages


def _applies(base: str, delta: str, new: str) -> bool:
    old_plain, new_plain = plain_lines(base), plain_lines(new)
    pairs = [(base, new)]
    if old_plain and new_plain:
        pairs.append((old_plain[1], new_plain[1]))
    for old, want in pairs:
        try:
            if apply_delta(old, delta) == want:
                return True
        except ValueError:
            continue
    return False


def _expands(text: str, earlier: list[Earlier], want: str) -> bool:
    try:
        return expand(text, earlier) == want
    except ValueError:
        return False


def test_the_ledger_names_each_form(tmp_path: Path) -> None:
    from proxy.ledger.changes import describe

    history = session(7, 30)
    off = offloader(tmp_path)
    seen = len(history) - 10
    out = forward(off, history, seen)
    changes = describe(history, out.messages, tenant="t", session="s")
    kinds = {c.what for c in changes}
    assert kinds & {"superseded", "stale"} and kinds & {"unchanged", "delta", "duplicate"}
    saved = {f.rid for f in out.files}
    for c in changes:
        assert c.file is not None and c.file.removeprefix("tool_result/").removesuffix(".txt") in saved
        assert c.reason and c.bytes_after < c.bytes_before
