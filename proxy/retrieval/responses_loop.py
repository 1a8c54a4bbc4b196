"""The read-tool loop for the Responses API: the proxy's own ``function_call`` items are run by
the proxy and never reach the client (docs/retrieval.md,
docs/formats.md#the-read-tool-in-responses).

A round whose output calls only the proxy's tool is internal: its calls are answered with
``function_call_output`` items and the model is asked again, the round's output items (reasoning
with its encrypted content included) and the results appended to ``input`` (or, for a request
that continues a stored response, the next round continues the round's response). A round that
calls the client's tools, or nothing, is the answer; the proxy's calls in it are dropped from
the client's copy (run all the same, and kept for later turns with the model's output: loop.Rounds).

Non-streaming, the client gets the last round's response without the proxy's calls, usage summed
over the rounds (an answer of one round without them: its bytes as they came). Streaming,
events pass as they come, byte for byte (:func:`~proxy.retrieval.loop.frame`), with three
changes: the proxy's call items (and their argument deltas) are withheld, with a reasoning item
that leads straight into one (the client must never hold a reasoning item without the item that
followed it; a reasoning item's events wait for the next item to start); once an event was
withheld, ``output_index`` and ``sequence_number`` are renumbered (those members alone) so the
client sees one response with consecutive items; the ``response.created``/``in_progress`` of
later rounds and the terminal event of internal rounds are withheld, and when something was
withheld the final ``response.completed`` carries every item the client saw (usage summed when
there were several rounds). An upstream that ends its streams with ``data: [DONE]`` (an
OpenAI-compatible gateway) ends the client's once, after the last round's terminal event: a
round's own would end the client's stream there (the openai SDK stops reading at it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from starlette.types import Send
from yarl import URL

from proxy import rawjson as json
from proxy.errors import ProxyError
from proxy.retrieval.loop import (
    Encoder,
    Finish,
    OnStatus,
    ReaderBase,
    Rounds,
    Settled,
    StreamOut,
    frame,
)
from proxy.server.asgi import Headers, send_whole
from proxy.session import Identity
from proxy.upstream.http import response_headers
from proxy.upstream.relay import read_whole
from proxy.upstream.thinking import Binding

__all__ = ["ResponsesReader"]

log = logging.getLogger("proxy.upstream")

_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_OPENING = frozenset({"response.created", "response.in_progress", "response.queued"})
_CLIENT_CALLS = frozenset({"function_call", "custom_tool_call", "local_shell_call", "shell_call",
                           "apply_patch_call", "computer_call", "program"})


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _input_items(given: Any) -> list[Any]:
    """The items of a request's ``input``: a string is one user message."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given) if isinstance(given, list) else []


class ResponsesReader(ReaderBase):
    def with_tool(self, body: dict[str, Any]) -> dict[str, Any]:
        tools = body.get("tools")
        tools = list(tools) if isinstance(tools, list) else []
        if any(isinstance(t, dict) and t.get("name") == self.tool.name for t in tools):
            return body
        fn = self.tool.definition()["function"]
        return {**body, "tools": [*tools, {"type": "function", **fn}]}

    def _ours(self, item: Any) -> bool:
        return (isinstance(item, dict) and item.get("type") == "function_call"
                and item.get("name") == self.tool.name)

    async def _results(
        self, identity: Identity, calls: list[dict[str, Any]], rounds: int, settled: Settled
    ) -> list[dict[str, Any]]:
        return await self._reads(
            identity, calls, rounds, settled, lambda c: c.get("arguments") or "{}",
            lambda c, text: {"type": "function_call_output", "call_id": c.get("call_id"),
                             "output": text})

    async def _dropped(self, state: Rounds, identity: Identity, output: list[Any],
                       ours: list[dict[str, Any]], settled: Settled) -> None:
        """The answer's calls of the proxy's tool are dropped from the client's copy: run them
        anyway and keep the model's output with their results (see loop.Rounds)."""
        results = await self._results(identity, ours, state.rounds, settled)
        state.full = [orjson.dumps(i) for i in output]
        state.results = [orjson.dumps(r) for r in results]

    @staticmethod
    def _encoder(body: dict[str, Any], raw: bytes | None) -> Encoder:
        return Encoder(body, raw, "input", _input_items)

    @staticmethod
    def _next(
        encoder: Encoder, output: list[Any], results: list[dict[str, Any]], response_id: Any,
    ) -> bytes:
        body = encoder.body
        if body.get("previous_response_id") or body.get("conversation"):
            # The history lives upstream: continue the round's stored response.
            return encoder.continued({"previous_response_id": response_id, "input": results},
                                     ("conversation",))
        return encoder.request([json.dumps(i) for i in (*output, *results)])

    # -- not streaming ---------------------------------------------------------------------

    async def non_stream(
        self, send: Send, body: dict[str, Any], url: URL, headers: list[tuple[str, str]],
        extra: Headers, identity: Identity, tap: Callable[[bytes], None],
        on_status: OnStatus = None, settled: Settled = None, finish: Finish = None,
        raw: bytes | None = None, binding: Binding | None = None,
    ) -> Rounds:
        state = Rounds()
        encoder = self._encoder(body, raw)
        req = encoder.request()
        while True:
            last = state.rounds > self.max_rounds
            resp = await self._post(state, url, headers, req, on_status)
            async with resp:
                payload = await read_whole(resp)
                out_headers = response_headers(resp)
                status = resp.status
            data = _response(payload) if status == 200 else None
            if data is None:  # errors and odd bodies pass through as they came
                await send_whole(send, status, out_headers + extra, self._scrub(status, payload))
                return state
            state.add_usage(data.get("usage"))
            output = data["output"]
            ours = [i for i in output if self._ours(i)]
            theirs = [i for i in output if not self._ours(i) and isinstance(i, dict)
                      and i.get("type") in _CLIENT_CALLS]
            if ours and not theirs and not last:
                results = await self._results(identity, ours, state.rounds, settled)
                state.internal += [*output, *results]
                state.wire += [orjson.dumps(i) for i in (*output, *results)]
                req = self._next(encoder, output, results, data.get("id"))
                state.rounds += 1
                continue
            if ours:
                await self._dropped(state, identity, output, ours, settled)
            if state.rounds == 0 and not ours:
                final = payload  # nothing of ours happened: the bytes as they came
            else:
                data["output"] = _without(output, self._ours)
                if state.usage is not None:
                    data["usage"] = state.usage
                final = orjson.dumps(data)
            return await self._answer(send, status, out_headers + extra, final, state, tap,
                                      settled, finish)

    # -- streaming ---------------------------------------------------------------------------

    async def stream(
        self, send: Send, body: dict[str, Any], url: URL, headers: list[tuple[str, str]],
        extra: Headers, identity: Identity, tap: Callable[[bytes], None],
        on_status: OnStatus = None, settled: Settled = None, finish: Finish = None,
        raw: bytes | None = None, binding: Binding | None = None,
    ) -> Rounds:
        state = Rounds()
        view = _ClientView()
        encoder = self._encoder(body, raw)
        req = encoder.request()
        out = StreamOut(send, tap, extra, self._scrub)
        while True:
            last = state.rounds > self.max_rounds
            rnd = _Round(self._ours, view, first=state.rounds == 0)
            try:
                resp = await self._post(state, url, headers, req, on_status)
                async with resp:
                    if not await out.relay(resp, rnd.feed):
                        return state
            except ProxyError as exc:
                await out.fail(exc, lambda e: _event("error", {
                    "type": "error", "code": e.code, "message": e.message, "param": None,
                    "sequence_number": view.sequence()}))
                return state
            state.add_usage(rnd.usage)
            if rnd.failed:
                await out.end()
                return state
            if rnd.ours and not rnd.theirs and not last and rnd.terminal is not None:
                results = await self._results(identity, rnd.ours, state.rounds, settled)
                state.internal += [*rnd.output, *results]
                state.wire += [orjson.dumps(i) for i in (*rnd.output, *results)]
                req = self._next(encoder, rnd.output, results, rnd.response_id)
                state.rounds += 1
                continue
            for chunk in rnd.finish(state.usage):
                out.hold(chunk)
            if rnd.done:
                out.hold(frame("", b"[DONE]"))
            if rnd.ours and rnd.terminal is not None:
                await self._dropped(state, identity, rnd.output, rnd.ours, settled)
            break
        if settled is not None:
            await settled()
        if finish is not None:
            await finish(state)
        await out.release()
        await out.end()
        return state


class _ClientView:
    """What the client has seen across rounds: its items and the numbering it expects."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._seq = 0
        # Nothing was withheld yet: the upstream's own numbering is the client's.
        self.exact = True
        self.withheld = False  # an item was withheld (the terminal's output is not the client's)

    def sequence(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def number(self, given: Any) -> int | None:
        """The client's ``sequence_number`` for an event the upstream numbered ``given``; None
        when it stays as it came."""
        if not isinstance(given, int) or isinstance(given, bool):
            return None  # not numbered upstream: not numbered here
        if self.exact:
            self._seq = given + 1
            return None
        seq = self.sequence()
        return None if seq == given else seq


# One event as it came: (event name, type, data, its bytes)
_Held = tuple[str, str, dict[str, Any], bytes]


class _Round:
    """Filters one round's events (see the module docstring)."""

    def __init__(self, ours: Callable[[Any], bool], view: _ClientView, *, first: bool) -> None:
        self.is_ours = ours
        self.view = view
        self.first = first
        if not first:
            view.exact = False  # a later round numbers its events from 0 again
        self.ours: list[dict[str, Any]] = []
        self.theirs: list[Any] = []
        self.output: list[Any] = []  # every item of the round, in order (for the next input)
        self.usage: Any = None
        self.response_id: Any = None
        self.terminal: _Held | None = None
        self.failed = False
        self.done = False  # the upstream ended the round's stream with [DONE]
        self._index: dict[int, int] = {}  # upstream output_index -> the client's
        self._hidden: set[int] = set()  # upstream output_index withheld
        self._held: list[_Held] = []  # a reasoning item's events, pending
        self._held_index: int | None = None

    def _out(self, name: str, kind: str, data: dict[str, Any], raw: bytes,
             changes: dict[str, Any] | None = None) -> bytes:
        """The event for the client: as it came, or with the members ``changes`` names (and
        its ``sequence_number``, once the numbering moved) spliced in."""
        replace = {k: json.dumps(v) for k, v in (changes or {}).items()}
        seq = self.view.number(data.get("sequence_number"))
        if seq is not None:
            replace["sequence_number"] = json.dumps(seq)
        if not replace:
            return frame(name, raw)
        return frame(name or kind, json.splice(json.members(raw), replace))

    def _withhold(self) -> list[bytes]:
        self.view.exact = False
        return []

    def feed(self, name: str, raw: bytes) -> list[bytes]:
        if raw.strip() == b"[DONE]":
            self.done = True  # the stream's end, sent once by the loop (module docstring)
            return []
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return [frame(name, raw)]
        if not isinstance(data, dict):
            return [frame(name, raw)]
        found = data.get("type")
        kind: str = found if isinstance(found, str) else name
        if kind == "error" or name == "error":
            self.failed = True
            return [self._out(name, kind or "error", data, raw)]
        if kind in _OPENING:
            response = data.get("response")
            if isinstance(response, dict):
                self.response_id = response.get("id")
            return [self._out(name, kind, data, raw)] if self.first else self._withhold()
        if kind in _TERMINAL:
            response = data.get("response")
            if isinstance(response, dict):
                self.usage = response.get("usage")
                self.response_id = response.get("id", self.response_id)
            self.terminal = (name, kind, data, raw)
            return self._flush()
        index = data.get("output_index")
        if not isinstance(index, int) or isinstance(index, bool):
            return [self._out(name, kind, data, raw)]
        if kind == "response.output_item.added":
            item = data.get("item")
            if self.is_ours(item):
                self._hidden.add(index)
                self.view.withheld = True
                # A reasoning item that leads straight into the proxy's call goes with it.
                if self._held_index is not None:
                    self._hidden.add(self._held_index)
                    self._held.clear()
                    self._held_index = None
                return self._withhold()
            out = self._flush()
            if isinstance(item, dict) and item.get("type") == "reasoning":
                self._held_index = index
                self._held.append((name, kind, data, raw))
                return out
            return out + self._visible((name, kind, data, raw), index)
        if kind == "response.output_item.done":
            item = data.get("item")
            if isinstance(item, dict):
                self.output.append(item)
                if self.is_ours(item):
                    self.ours.append(item)
                elif item.get("type") in _CLIENT_CALLS:
                    self.theirs.append(item)
        if index in self._hidden:
            return self._withhold()
        if index == self._held_index:
            self._held.append((name, kind, data, raw))
            return []
        return self._visible((name, kind, data, raw), index)

    def _visible(self, event: _Held, index: int) -> list[bytes]:
        name, kind, data, raw = event
        if index not in self._index:
            self._index[index] = len(self.view.items)
            self.view.items.append(None)
        mine = self._index[index]
        if kind == "response.output_item.done":
            self.view.items[mine] = data.get("item")
        return [self._out(name, kind, data, raw, {"output_index": mine} if mine != index else None)]

    def _flush(self) -> list[bytes]:
        held, self._held = self._held, []
        index, self._held_index = self._held_index, None
        if index is None:
            return []
        out: list[bytes] = []
        for event in held:
            out += self._visible(event, index)
        return out

    def finish(self, usage: Any) -> list[bytes]:
        """The terminal event of the answer's round: after several rounds, or items withheld,
        with what the client saw in all rounds (usage summed when there were rounds before)."""
        if self.terminal is None:
            return []
        name, kind, data, raw = self.terminal
        response = data.get("response")
        changes: dict[str, Any] | None = None
        if isinstance(response, dict) and (self.view.withheld or not self.first):
            response = {**response, "output": [i for i in self.view.items if i is not None]}
            if usage is not None and not self.first:
                response["usage"] = usage
            changes = {"response": response}
        return [self._out(name, kind, data, raw, changes)]


def _response(payload: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("output"), list):
        return None
    return data


def _without(output: list[Any], ours: Callable[[Any], bool]) -> list[Any]:
    """The output without the proxy's calls, nor a reasoning item leading straight into one."""
    kept: list[Any] = []
    for item in output:
        if ours(item):
            if kept and isinstance(kept[-1], dict) and kept[-1].get("type") == "reasoning":
                kept.pop()
            continue
        kept.append(item)
    return kept
