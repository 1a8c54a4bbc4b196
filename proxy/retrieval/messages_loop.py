"""The read-tool loop for the Anthropic Messages API: the proxy's own ``tool_use`` blocks are
run by the proxy and never reach the client (docs/retrieval.md,
docs/formats.md#the-read-tool-in-messages).

A round whose answer calls only the proxy's tool is internal: its calls are answered with
``tool_result`` blocks and the model is asked again, the round's assistant message (thinking
blocks and their signatures as they came) and a user message with the results appended to
``messages`` (not streaming, the assistant content as the upstream's bytes; streaming, as
assembled from the deltas). A round that calls the client's tools, or nothing, is the answer;
the proxy's calls in it are dropped from the client's copy (its thinking blocks stay: a thinking
block may end a turn, and the turn's first block must stay a thinking block when tools follow),
run all the same and kept for later turns with the model's message (loop.Rounds).

Non-streaming, the client gets the last round's message without the proxy's calls, usage summed
over the rounds (an answer of one round without them: its bytes as they came). Streaming, events
pass as they come, byte for byte (:func:`~proxy.retrieval.loop.frame`), with three changes: the
proxy's ``tool_use`` blocks (start, input deltas, stop) are withheld; a content-block ``index``
after a withheld block is renumbered (that member alone) so the client sees one message with
consecutive blocks; the ``message_start`` of later rounds and the ``message_delta``/
``message_stop`` of internal rounds are withheld, and after several rounds the final
``message_delta`` carries the usage summed over them (its ``stop_reason`` is ``end_turn`` when
only the proxy's calls were dropped from it).

Every round posts through the request's :class:`~proxy.upstream.thinking.Binding`: a round
refused by Anthropic's prefix check is sent again with drop_block, and the later rounds keep it
(``x-ctxproxy-thinking`` is on the answer when the recovery came before the response started).
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
from proxy.formats.messages.answer import MessagesAssembler
from proxy.retrieval.loop import Finish, OnStatus, ReaderBase, Rounds, Settled, StreamOut, frame
from proxy.server.asgi import Headers, send_whole
from proxy.session import Identity
from proxy.upstream.http import response_headers
from proxy.upstream.relay import anthropic_error_event, read_whole
from proxy.upstream.thinking import Binding

__all__ = ["MessagesReader"]

log = logging.getLogger("proxy.upstream")


class MessagesReader(ReaderBase):
    def definition(self) -> dict[str, Any]:
        fn = self.tool.definition()["function"]
        return {"name": fn["name"], "description": fn["description"],
                "input_schema": fn["parameters"]}

    def with_tool(self, body: dict[str, Any]) -> dict[str, Any]:
        tools = body.get("tools")
        tools = list(tools) if isinstance(tools, list) else []
        if any(isinstance(t, dict) and t.get("name") == self.tool.name for t in tools):
            return body
        return {**body, "tools": [*tools, self.definition()]}

    def _ours(self, block: Any) -> bool:
        return (isinstance(block, dict) and block.get("type") == "tool_use"
                and block.get("name") == self.tool.name)

    def _split(self, content: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
        ours = [b for b in content if self._ours(b)]
        theirs = [b for b in content if not self._ours(b) and isinstance(b, dict)
                  and b.get("type") == "tool_use"]
        return ours, theirs

    async def _results(
        self, identity: Identity, calls: list[dict[str, Any]], rounds: int, settled: Settled
    ) -> list[dict[str, Any]]:
        return await self._reads(
            identity, calls, rounds, settled,
            lambda c: orjson.dumps(c.get("input") or {}).decode(),
            lambda c, text: {"type": "tool_result", "tool_use_id": c.get("id"), "content": text})

    async def _dropped(self, state: Rounds, identity: Identity, said: bytes,
                       ours: list[dict[str, Any]], settled: Settled) -> None:
        """The answer's calls of the proxy's tool are dropped from the client's copy: run them
        anyway and keep the model's message with their ``tool_result`` blocks (loop.Rounds)."""
        results = await self._results(identity, ours, state.rounds, settled)
        state.full = [said]
        state.results = [json.dumps(r) for r in results]

    def _encoder(self, body: dict[str, Any], raw: bytes | None) -> _Encoder:
        return _Encoder(body, raw, self.definition())

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
        extra = [*extra]
        while True:
            last = state.rounds > self.max_rounds
            resp = await self._post(state, url, headers, req, on_status, binding)
            _mark(extra, binding)
            async with resp:
                payload = await read_whole(resp)
                out_headers = response_headers(resp)
                status = resp.status
            data = _message(payload) if status == 200 else None
            if data is None:  # errors and odd bodies pass through as they came
                await send_whole(send, status, out_headers + extra, self._scrub(status, payload))
                return state
            state.add_usage(data.get("usage"))
            content = data["content"]
            ours, theirs = self._split(content)
            # The assistant message as the upstream sent its content, signed thinking included.
            said = (b'{"role":"assistant","content":' + bytes(json.members(payload)["content"])
                    + b"}") if ours else b""
            if ours and not theirs and not last:
                results = await self._results(identity, ours, state.rounds, settled)
                state.internal += [{"role": "assistant", "content": content},
                                   {"role": "user", "content": results}]
                req = encoder.request(said, results, state)
                state.rounds += 1
                continue
            if ours:
                await self._dropped(state, identity, said, ours, settled)
            if state.rounds == 0 and not ours:
                final = payload  # nothing of ours happened: the bytes as they came
            else:
                data["content"] = [b for b in content if not self._ours(b)]
                if not theirs and data.get("stop_reason") == "tool_use":
                    data["stop_reason"] = "end_turn"
                if state.usage is not None:
                    data["usage"] = {**(data.get("usage") or {}), **state.usage}
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
        seen = [0]  # content blocks the client has seen, over all rounds
        encoder = self._encoder(body, raw)
        req = encoder.request()
        extra = [*extra]  # StreamOut's: a recovery before the response starts is in its headers
        out = StreamOut(send, tap, extra, self._scrub)
        while True:
            last = state.rounds > self.max_rounds
            rnd = _Round(self._ours, seen, first=state.rounds == 0)
            try:
                resp = await self._post(state, url, headers, req, on_status, binding)
                _mark(extra, binding)
                async with resp:
                    if not await out.relay(resp, rnd.feed):
                        return state
            except ProxyError as exc:
                await out.fail(exc, lambda e: anthropic_error_event(e.message,
                                                                    e.code or "upstream_error"))
                return state
            state.add_usage(rnd.usage())
            if rnd.failed:
                await out.end()
                return state
            content = rnd.assembler.content()
            ours, theirs = self._split(content)
            # A stream has no bytes of the content array: the assembled blocks (the thinking
            # text and signature are the deltas' exact strings).
            said = json.dumps({"role": "assistant", "content": content}) if ours else b""
            if ours and not theirs and not last and rnd.stopped:
                results = await self._results(identity, ours, state.rounds, settled)
                state.internal += [{"role": "assistant", "content": content},
                                   {"role": "user", "content": results}]
                req = encoder.request(said, results, state)
                state.rounds += 1
                continue
            for chunk in rnd.finish(state.usage, bool(ours) and not theirs):
                out.hold(chunk)
            if ours and rnd.stopped:
                await self._dropped(state, identity, said, ours, settled)
            break
        if settled is not None:
            await settled()
        if finish is not None:
            await finish(state)
        await out.release()
        await out.end()
        return state


class _Encoder:
    """Each round's request bytes: the client's body as it was forwarded, byte for byte (its
    signed thinking blocks included), the read tool appended to ``tools``, and the internal
    rounds' messages appended to ``messages``."""

    def __init__(self, body: dict[str, Any], raw: bytes | None, tool: dict[str, Any]) -> None:
        self.body = body
        self.raw = raw
        self.tool = tool
        self.added: list[bytes] = []

    def request(
        self, said: bytes | None = None, results: list[dict[str, Any]] | None = None,
        state: Rounds | None = None,
    ) -> bytes:
        """The next round's bytes; ``said``, the round's assistant message (bytes), and its
        ``results`` appended first (and kept in ``state.wire``, as sent)."""
        if said is not None and results is not None:
            added = [said, json.dumps({"role": "user", "content": results})]
            self.added += added
            if state is not None:
                state.wire += added
        if self.raw is None:
            messages = [*(self.body.get("messages") or []), *map(orjson.loads, self.added)]
            return orjson.dumps({**self.body, "messages": messages})
        members = json.members(self.raw)
        replace: dict[str, json.RawJSON] = {}
        tools = members.get("tools")
        given = orjson.loads(bytes(tools)) if tools is not None else None
        if not isinstance(given, list):
            replace["tools"] = json.join_array([json.dumps(self.tool)])
        elif not any(isinstance(t, dict) and t.get("name") == self.tool["name"] for t in given):
            assert tools is not None
            replace["tools"] = json.join_array([*json.array_items(tools), json.dumps(self.tool)])
        if self.added:
            replace["messages"] = json.join_array(
                [*json.array_items(members["messages"]), *self.added])
        return json.splice(members, replace)


class _Round:
    """Filters one round's events (see the module docstring)."""

    def __init__(self, ours: Callable[[Any], bool], seen: list[int], *, first: bool) -> None:
        self.is_ours = ours
        self.seen = seen
        self.first = first
        self.assembler = MessagesAssembler()
        self.failed = False
        self.stopped = False  # message_stop arrived
        self._index: dict[int, int] = {}  # upstream index -> the client's
        self._hidden: set[int] = set()
        # message_delta, message_stop: (event name, type, data, its bytes)
        self._held: list[tuple[str, str, dict[str, Any], bytes]] = []

    def usage(self) -> dict[str, Any] | None:
        message = self.assembler.message
        usage = message.get("usage") if message is not None else None
        return usage if isinstance(usage, dict) else None

    def feed(self, name: str, raw: bytes) -> list[bytes]:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return [frame(name, raw)]
        if not isinstance(data, dict):
            return [frame(name, raw)]
        found = data.get("type")
        kind: str = found if isinstance(found, str) else name
        self.assembler.feed(data)
        if kind == "error":
            self.failed = True
            return [frame(name, raw)]
        if kind == "message_start":
            return [frame(name, raw)] if self.first else []
        if kind in ("message_delta", "message_stop"):
            self.stopped = self.stopped or kind == "message_stop"
            self._held.append((name, kind, data, raw))
            return []
        index = data.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            return [frame(name, raw)]  # ping and what the loop does not know
        if kind == "content_block_start" and self.is_ours(data.get("content_block")):
            self._hidden.add(index)
        if index in self._hidden:
            return []
        if index not in self._index:
            self._index[index] = self.seen[0]
            self.seen[0] += 1
        mine = self._index[index]
        if mine == index:
            return [frame(name, raw)]
        return [frame(name or kind, json.splice(json.members(raw), {"index": json.dumps(mine)}))]

    def finish(self, usage: dict[str, Any] | None, dropped_only: bool) -> list[bytes]:
        """The held end of the answer's round: stop reason fixed when only the proxy's calls
        were in it, usage summed over the rounds when there were several; else as it came."""
        out: list[bytes] = []
        for name, kind, data, raw in self._held:
            replace: dict[str, json.RawJSON] = {}
            if kind == "message_delta":
                delta = data.get("delta")
                if dropped_only and isinstance(delta, dict) and delta.get("stop_reason") == "tool_use":
                    replace["delta"] = json.dumps({**delta, "stop_reason": "end_turn"})
                if usage is not None and not self.first:
                    given = data.get("usage")
                    replace["usage"] = json.dumps({**(given if isinstance(given, dict) else {}),
                                                   **usage})
            out.append(frame(name or kind, json.splice(json.members(raw), replace)) if replace
                       else frame(name, raw))
        return out


def _mark(extra: Headers, binding: Binding | None) -> None:
    """Put what ``binding`` did in the rounds so far into ``extra`` (in place: the stream's
    :class:`StreamOut` holds the same list), replacing what it said before."""
    if binding is not None:
        said = binding.headers()
        if said and said[0] not in extra:
            extra[:] = [h for h in extra if h[0] != said[0][0]] + said


def _message(payload: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("content"), list):
        return None
    return data
