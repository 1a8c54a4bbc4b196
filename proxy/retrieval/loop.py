"""The read-tool loop: run the model's `read_offloaded` calls and ask again.

See docs/retrieval.md#the-read-tool and docs/retrieval.md#what-the-client-sees.

The client only ever sees the final answer. Non-streaming: the last round's completion with
usage summed over rounds. Streaming: text deltas pass as they arrive, deltas of the proxy's own
tool calls are withheld, the client's tool calls pass through (renumbered to stay contiguous),
the next round continues in the same SSE response, and exactly one usage chunk comes at the end
(when the upstream sent one: the loop asks for no usage the client did not ask for).

What the loop need not change passes byte for byte, both ways: every round's request is the
forwarded body's bytes with only the read tool and the internal rounds spliced in
(:class:`Encoder`), and every chunk the loop does not have to change goes to the client as the
upstream sent it (:func:`frame`); an answer of one round without the proxy's calls arrives
exactly as the upstream sent it.

An answer that calls both the proxy's tool and the client's tools is returned with only the
client's calls, because the client could neither run the proxy's nor continue with a
half-answered turn. The proxy's calls are still run (after the answer is complete), and the
model's whole answer and their results kept with the rounds (:class:`Rounds`): later turns
forward the history as the model saw it (proxy.retrieval.replay).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec
import orjson
from starlette.types import Send
from yarl import URL

from proxy import rawjson as json
from proxy.errors import ProxyError, UpstreamError, UpstreamStatusError, UpstreamTimeout
from proxy.retrieval.tool import ReadTool
from proxy.server.asgi import Headers, send_whole
from proxy.session import Identity
from proxy.sse import SSEDecoder
from proxy.upstream.http import Upstream, response_headers
from proxy.upstream.relay import read_whole, redact_secret, sse_error_event
from proxy.upstream.thinking import Binding

log = logging.getLogger("proxy.upstream")

_DONE = b"data: [DONE]\n\n"
# Told each upstream status (held writes settle on the first, proxy.writes).
OnStatus = Callable[[int], Awaitable[None]] | None
# Awaited before the read tool runs: the files it reads may still be being written.
Settled = Callable[[], Awaitable[None]] | None


@dataclass
class Rounds:
    """What the loop did, for headers, the archive and tests."""

    rounds: int = 0
    internal: list[dict[str, Any]] = field(default_factory=list)  # the proxy's calls + results
    usage: dict[str, Any] | None = None
    # For putting the rounds back on later turns (proxy.retrieval.rounds): each internal wire item as it
    # was forwarded, and, when the answer's own calls of the proxy's tool were dropped from the
    # client's copy, the model's answer (wire items) and the results of those calls.
    wire: list[bytes] = field(default_factory=list)
    full: list[bytes] | None = None
    results: list[bytes] = field(default_factory=list)
    # For the ledger: every upstream call the loop made, in order, the first included (the
    # client sees ``usage`` summed, which no price applies to): the usage object each answer
    # reported as it came (None: none, e.g. an error), and when each was sent (unix seconds).
    calls: list[Any] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)

    @property
    def replayable(self) -> bool:
        return bool(self.wire) or self.full is not None

    def sent(self) -> None:
        """An upstream call goes out; :meth:`add_usage` tells what it reported."""
        self.calls.append(None)
        self.sent_at.append(time.time())

    def add_usage(self, usage: Any) -> None:
        """The usage the last call sent (:meth:`sent`): kept as it came, and summed."""
        if self.calls and usage is not None:
            self.calls[-1] = usage
        if not isinstance(usage, dict):
            return
        if self.usage is None:
            self.usage = {}
        for key, value in usage.items():
            if isinstance(value, int) and not isinstance(value, bool):
                self.usage[key] = self.usage.get(key, 0) + value
            elif isinstance(value, dict):
                inner = self.usage.setdefault(key, {})
                if isinstance(inner, dict):
                    for k, v in value.items():
                        if isinstance(v, int) and not isinstance(v, bool):
                            inner[k] = inner.get(k, 0) + v


# Awaited with what the loop did once the answer is complete, before its last byte (a shared
# store archives the answer then, so the client's next turn finds it on any replica).
Finish = Callable[[Rounds], Awaitable[None]] | None


def _split_calls(msg: dict[str, Any], name: str) -> tuple[list[Any], list[Any]]:
    calls = msg.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    ours = [c for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)
            and c["function"].get("name") == name]
    theirs = [c for c in calls if c not in ours]
    return ours, theirs


def frame(name: str, data: bytes) -> bytes:
    """One SSE event of the upstream's, framed as the decoder read it: its ``event`` name (none
    when it had none) and its data bytes as they came. What the decoder does not hand over
    (comments, ``id``/``retry`` fields, CRLF line ends) is not repeated."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    if 0x0A in data:  # data that came in several lines goes out in as many
        data = data.replace(b"\n", b"\ndata: ")
    return head + b"data: " + data + b"\n\n"


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


class Encoder:
    """Each round's request bytes: the forwarded body (``raw``) byte for byte, with only what
    the loop must change spliced in (:mod:`proxy.rawjson`): the read tool appended to
    ``tools`` (``body``, the same request parsed, has it: ``with_tool``) and every internal
    round's items appended to the conversation array ``key``. The tools stay the same in every
    round: a tools array that changed from one round (or turn) to the next would discard the
    provider's prompt cache. Without ``raw`` the dict is serialised whole.

    ``items`` turns the body's conversation value into its items when it is not an array (a
    Responses ``input`` string)."""

    def __init__(
        self, body: dict[str, Any], raw: bytes | None, key: str,
        items: Callable[[Any], list[Any]] = _list,
    ) -> None:
        self.body = body
        self.key = key
        self.items = items
        self.added: list[bytes] = []
        self.parts = json.members(raw) if raw is not None else None
        self.replace: dict[str, json.RawJSON] = {}
        tools = body.get("tools")
        if self.parts is not None and isinstance(tools, list):
            given = self._array(self.parts.get("tools"))
            if given is None:
                self.replace["tools"] = json.dumps(tools)
            elif len(given) < len(tools):  # with_tool appended the read tool
                self.replace["tools"] = json.join_array(
                    [*given, *(json.dumps(t) for t in tools[len(given):])])

    @staticmethod
    def _array(value: json.RawJSON | None) -> list[json.RawJSON] | None:
        if value is None:
            return None
        try:
            return json.array_items(value)
        except msgspec.DecodeError:  # not an array
            return None

    def request(self, added: Sequence[bytes] = ()) -> bytes:
        """The next round's bytes, ``added`` (the last round's items, JSON each) appended to
        the conversation after those of the rounds before."""
        self.added += added
        if self.parts is None:
            conversation = [*self.items(self.body.get(self.key)), *map(orjson.loads, self.added)]
            return orjson.dumps({**self.body, self.key: conversation} if self.added else self.body)
        replace = dict(self.replace)
        if self.added:
            items = self._array(self.parts.get(self.key))
            if items is None:
                items = [json.dumps(i) for i in self.items(self.body.get(self.key))]
            replace[self.key] = json.join_array([*items, *self.added])
        return json.splice(self.parts, replace)

    def continued(self, changes: dict[str, Any], drop: Sequence[str]) -> bytes:
        """A round that continues a response stored upstream: the forwarded body with the
        members of ``changes`` set and those of ``drop`` removed (the conversation grows
        upstream, so nothing is appended here)."""
        if self.parts is None:
            body = {k: v for k, v in self.body.items() if k not in drop}
            return orjson.dumps({**body, **changes})
        replace = {**self.replace, **{k: json.dumps(v) for k, v in changes.items()}}
        return json.splice(self.parts, replace, drop)


class ReaderBase:
    """What the three read loops share: the upstream, the tool, the round limit, and posting a
    round. Subclasses add the wire format's loop."""

    enabled = True

    def __init__(self, upstream: Upstream, tool: ReadTool, max_rounds: int) -> None:
        self.upstream = upstream
        self.tool = tool
        self.max_rounds = max_rounds

    def needed(self, messages: Sequence[Any]) -> bool:
        return self.tool.needed(messages)

    async def _reads(
        self, identity: Identity, calls: Sequence[dict[str, Any]], rounds: int, settled: Settled,
        arguments: Callable[[dict[str, Any]], str], result: Callable[[dict[str, Any], str], Any],
    ) -> list[Any]:
        """The results of the proxy's own calls (``result(call, text)`` in the wire format): the
        reads, off the event loop and after the files they read are written, or, past
        ``max_rounds``, a notice that reading is over for this turn (the model then answers with
        what it has)."""
        if rounds >= self.max_rounds:
            text = (f"error: the limit of {self.max_rounds} reads for this turn is reached; "
                    "continue with what you have read")
            return [result(c, text) for c in calls]
        if settled is not None:
            await settled()
        tool = self.tool

        def run() -> list[Any]:
            return [result(c, tool.run(identity, arguments(c))) for c in calls]

        return await asyncio.to_thread(run)

    @staticmethod
    async def _answer(
        send: Send, status: int, headers: Headers, final: bytes, state: Rounds,
        tap: Callable[[bytes], None], settled: Settled, finish: Finish,
    ) -> Rounds:
        """The whole answer at the end of a non-streamed loop: tapped, the held writes and (on a
        shared store) the archive done before it is sent, with the number of read rounds."""
        tap(final)
        if settled is not None:
            await settled()
        if finish is not None:
            await finish(state)
        rounds = (b"x-ctxproxy-read-rounds", str(state.rounds).encode())
        await send_whole(send, status, [*headers, rounds], final)
        return state

    def _scrub(self, status: int, payload: bytes) -> bytes:
        """An error body passes through without the proxy's own key (as the forwarder does)."""
        return redact_secret(payload, self.upstream.config.api_key) if status >= 400 else payload

    async def _post(
        self, state: Rounds, url: URL, headers: list[tuple[str, str]],
        req: dict[str, Any] | bytes, on_status: OnStatus, binding: Binding | None = None,
    ) -> aiohttp.ClientResponse:
        """One round's request, counted in ``state``; through ``binding`` (Messages), a
        prefix-check 400 is sent again with drop_block (:mod:`proxy.upstream.thinking`; the
        refused one is not billed, and not counted)."""
        data = req if isinstance(req, bytes) else orjson.dumps(req)
        state.sent()
        if binding is not None:
            resp = await binding.send(self.upstream, "POST", url, headers, data)
        else:
            resp = await self.upstream.send("POST", url, headers, data)
        if on_status is not None:
            await on_status(resp.status)
        return resp


class StreamOut:
    """The client's side of one streamed answer made of several upstream rounds: the response
    starts with the first round's headers, every chunk is tapped as it goes out, and a round that
    fails once the client has its 200 ends the stream with the wire format's error event."""

    def __init__(self, send: Send, tap: Callable[[bytes], None], extra: Headers,
                 scrub: Callable[[int, bytes], bytes]) -> None:
        self.send = send
        self.tap = tap
        self.extra = extra
        self.scrub = scrub
        self.started = False
        self._held: list[bytes] = []

    async def emit(self, chunk: bytes) -> None:
        self.tap(chunk)
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    def hold(self, chunk: bytes) -> None:
        """The end of the answer: tapped now (the answer is complete for what is kept before
        it goes out: the archive, the read rounds a next turn replays), sent by :meth:`release`.
        A client acts on the answer's last events at once (Codex runs the command and sends its
        next request), so nothing it could send next may overtake what the proxy keeps."""
        self.tap(chunk)
        self._held.append(chunk)

    async def release(self) -> None:
        held, self._held = self._held, []
        for chunk in held:
            await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def relay(
        self, resp: aiohttp.ClientResponse, feed: Callable[[str, bytes], Iterable[bytes]]
    ) -> bool:
        """Relay one round's events through ``feed(event name, data)``. False when the upstream
        answered something else than a stream before the client's response started: that answer
        went to the client whole, and the loop is over."""
        if resp.status != 200 or resp.content_type != "text/event-stream":
            payload = self.scrub(resp.status, await read_whole(resp))
            if not self.started:
                await send_whole(self.send, resp.status, response_headers(resp) + self.extra,
                                 payload)
                return False
            raise UpstreamStatusError(f"upstream answered {resp.status} in a read round")
        if not self.started:
            await self.send({"type": "http.response.start", "status": 200,
                             "headers": response_headers(resp) + self.extra})
            self.started = True
        decoder = SSEDecoder()
        try:
            async for chunk in resp.content.iter_any():
                for event in decoder.feed(chunk):
                    for out in feed(event.event, event.data):
                        await self.emit(out)
        except TimeoutError:
            raise UpstreamTimeout("upstream stream stalled") from None
        except aiohttp.ClientError:
            raise UpstreamError("upstream stream broke off", code="upstream_stream_broken") from None
        return True

    async def fail(self, exc: ProxyError, event: Callable[[ProxyError], bytes]) -> None:
        """A round failed. Before the client's response started, the error is its answer
        (raised again); after, the stream ends with ``event(exc)`` (no further round)."""
        if not self.started:
            raise exc
        log.warning("read round failed: %s", exc.message)
        await self.emit(event(exc))
        await self.end()

    async def end(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class Reader(ReaderBase):
    """The read tool for one upstream: when it is needed, its definition, and the loop."""

    def with_tool(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.tool.with_tool(body)

    async def _results(
        self, identity: Identity, calls: list[Any], rounds: int, settled: Settled
    ) -> list[dict[str, Any]]:
        return await self._reads(
            identity, calls, rounds, settled,
            lambda c: (c.get("function") or {}).get("arguments") or "{}",
            lambda c, text: {"role": "tool", "tool_call_id": c.get("id"), "content": text})

    async def _dropped(self, state: Rounds, identity: Identity, msg: dict[str, Any],
                       ours: list[Any], settled: Settled) -> None:
        """The answer's calls of the proxy's tool are dropped from the client's copy: run
        them anyway and keep the model's message with their results (see :class:`Rounds`)."""
        results = await self._results(identity, ours, state.rounds, settled)
        state.full = [orjson.dumps(msg)]
        state.results = [orjson.dumps(r) for r in results]

    async def non_stream(
        self, send: Send, body: dict[str, Any], url: URL, headers: list[tuple[str, str]],
        extra: Headers, identity: Identity, tap: Callable[[bytes], None],
        on_status: OnStatus = None, settled: Settled = None, finish: Finish = None,
        raw: bytes | None = None, binding: Binding | None = None,
    ) -> Rounds:
        state = Rounds()
        encoder = Encoder(body, raw, "messages")
        req = encoder.request()
        while True:
            last = state.rounds > self.max_rounds
            resp = await self._post(state, url, headers, req, on_status)
            async with resp:
                payload = await read_whole(resp)
                out_headers = response_headers(resp)
                status = resp.status
            data = _completion(payload) if status == 200 else None
            if data is None:  # errors and odd bodies pass through as they came
                await send_whole(send, status, out_headers + extra, self._scrub(status, payload))
                return state
            state.add_usage(data.get("usage"))
            msg = data["choices"][0].get("message") or {}
            ours, theirs = _split_calls(msg, self.tool.name)
            if ours and not theirs and not last:
                results = await self._results(identity, ours, state.rounds, settled)
                req = encoder.request([json.dumps(m) for m in (msg, *results)])
                state.internal += [msg, *results]
                state.wire += [orjson.dumps(m) for m in (msg, *results)]
                state.rounds += 1
                continue
            if state.rounds == 0 and not ours:
                final = payload  # nothing of ours happened: the client gets the bytes as they came
            else:
                if ours:
                    await self._dropped(state, identity, msg, ours, settled)
                    _drop_calls(data["choices"][0], theirs)
                if state.usage is not None:
                    data["usage"] = state.usage
                final = orjson.dumps(data)
            return await self._answer(send, status, out_headers + extra, final, state, tap,
                                      settled, finish)

    async def stream(
        self, send: Send, body: dict[str, Any], url: URL, headers: list[tuple[str, str]],
        extra: Headers, identity: Identity, tap: Callable[[bytes], None],
        on_status: OnStatus = None, settled: Settled = None, finish: Finish = None,
        raw: bytes | None = None, binding: Binding | None = None,
    ) -> Rounds:
        state = Rounds()
        # The upstream is asked for no usage the client did not ask for (stream_options stays
        # as forwarded): the loop relays what comes, summed when there were several rounds.
        encoder = Encoder(body, raw, "messages")
        req = encoder.request()
        meta: dict[str, Any] = {}
        client_index: dict[int, int] = {}
        out = StreamOut(send, tap, extra, self._scrub)
        while True:
            last = state.rounds > self.max_rounds
            rnd = _Round(self.tool.name, client_index, meta, first=state.rounds == 0)
            try:
                resp = await self._post(state, url, headers, req, on_status)
                async with resp:
                    if not await out.relay(resp, rnd.feed):
                        return state
            except ProxyError as exc:
                # The client has its 200 (and maybe text): the stream ends with an error event
                # and no [DONE], as a stream broken mid-way ends.
                await out.fail(exc, lambda e: sse_error_event(e.message,
                                                              e.code or "upstream_error"))
                return state
            state.add_usage(rnd.usage)
            if rnd.failed:
                await out.end()
                return state
            if rnd.internal and not last:
                calls = rnd.our_calls()
                msg = {"role": "assistant", "content": rnd.text or None, "tool_calls": calls}
                results = await self._results(identity, calls, state.rounds, settled)
                req = encoder.request([json.dumps(m) for m in (msg, *results)])
                state.internal += [msg, *results]
                state.wire += [orjson.dumps(m) for m in (msg, *results)]
                state.rounds += 1
                continue
            for chunk in rnd.finish(meta):
                out.hold(chunk)
            if rnd.ours:
                whole = {"role": "assistant", "content": rnd.text or None,
                         "tool_calls": rnd.all_calls()}
                await self._dropped(state, identity, whole, rnd.our_calls(), settled)
            break
        if rnd.usage_sent:
            pass
        elif state.rounds == 0 and rnd.usage_chunk is not None:
            out.hold(frame("", rnd.usage_chunk))  # one round: its usage as it came
        elif state.usage is not None:
            out.hold(b"data: " + orjson.dumps({**meta, "object": "chat.completion.chunk",
                                                "choices": [], "usage": state.usage})
                     + b"\n\n")
        if settled is not None:
            await settled()  # held writes done before the answer is complete
        out.hold(_DONE)
        if finish is not None:
            await finish(state)
        await out.release()
        await out.end()
        return state


class _Round:
    """Filters one round's chunks: withholds the proxy's tool calls, the end of a round that may
    go on (its finish chunk) and a usage chunk that is to be summed. A chunk it need not change
    goes out as it came."""

    def __init__(self, name: str, client_index: dict[int, int], meta: dict[str, Any], *,
                 first: bool = True) -> None:
        self.name = name
        self.meta = meta  # id, created, model of the answer, from the first chunks
        self.first = first  # the answer's first round: its usage need not be summed
        self.mine: dict[int, bool] = {}
        self.calls: dict[int, dict[str, Any]] = {}
        self.client_index = client_index
        self.ours = False
        self.theirs = False
        self.text = ""
        self.usage: Any = None
        self.pending_finish: dict[str, Any] | None = None
        self.pending_raw: bytes | None = None  # its chunk, when nothing else was in it
        self.failed = False
        # The round's finish chunk went to the client (no call of the proxy's came before it):
        # the round is the answer, whatever follows.
        self.closed = False
        self.usage_chunk: bytes | None = None  # the upstream's own usage chunk, as it came
        self.usage_sent = False  # ... and it went to the client as it came

    @property
    def internal(self) -> bool:
        """Whether the round called only the proxy's tool (and the loop may ask again)."""
        return self.ours and not self.theirs and not self.closed

    def feed(self, event: str, data: bytes) -> list[bytes]:
        meta = self.meta
        if data == b"[DONE]":
            return []
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return [frame(event, data)]
        if not isinstance(chunk, dict):
            return [frame(event, data)]
        if chunk.get("error") is not None:
            # The upstream failed mid-stream: the client sees its error as it came, and the
            # stream ends there (no further round, no [DONE]).
            self.failed = True
            return [frame(event, data)]
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in meta:
                meta[key] = chunk[key]
        # A usage after the end of a first round that was the answer is the answer's: as it came.
        as_sent = self.first and self.closed
        changed = False
        choices = chunk.get("choices")
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
            if not isinstance(choices, list) or not choices:
                if as_sent:
                    self.usage_sent = True
                    return [frame(event, data)]
                self.usage_chunk = data  # sent at the very end (summed if there were rounds)
                return []
            if not as_sent:
                del chunk["usage"]
                changed = True
        if not isinstance(choices, list) or not choices:
            return [frame(event, data)]  # not a chunk the loop reads
        out_choices = []
        finish_here = held = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):  # not a delta the loop can read: as it came
                out_choices.append(choice)
                continue
            if isinstance(delta.get("content"), str):
                self.text += delta["content"]
            kept = []
            calls = delta.get("tool_calls")
            for tc in calls if isinstance(calls, list) else []:
                idx = tc.get("index", 0) if isinstance(tc, dict) else None
                if not isinstance(idx, int):
                    kept.append(tc)  # malformed: the client's problem, passed on untouched
                    continue
                fn = tc.get("function")
                fn = fn if isinstance(fn, dict) else {}
                if idx not in self.mine:
                    self.mine[idx] = fn.get("name") == self.name
                    if self.mine[idx]:
                        self.ours = True
                    else:
                        self.theirs = True
                        self.client_index.setdefault(idx, len(self.client_index))
                # Every call assembled (the client's too: the model's whole message is kept
                # when the answer mixes both, see Rounds).
                call = self.calls.setdefault(idx, {"id": tc.get("id"), "type": "function",
                                                    "function": {"name": fn.get("name"),
                                                                 "arguments": ""}})
                args = fn.get("arguments")
                call["function"]["arguments"] += args if isinstance(args, str) else ""
                if self.mine[idx]:
                    continue
                kept.append({**tc, "index": self.client_index[idx]})
            if isinstance(calls, list) and kept != calls:  # a call withheld or renumbered
                changed = True
                delta = {**delta, "tool_calls": kept} if kept else {k: v for k, v in delta.items() if k != "tool_calls"}
            choice = {**choice, "delta": delta}
            if choice.get("finish_reason") is not None and self.ours:
                # The round may go on (or its reason be fixed): known only at its end.
                self.pending_finish = choice
                held = True
                continue
            finish_here = finish_here or choice.get("finish_reason") is not None
            if delta or choice.get("logprobs"):
                out_choices.append(choice)
        self.closed = self.closed or finish_here
        if held:
            # Held whole when it is nothing but the finish: it may still go out as it came.
            self.pending_raw = data if not changed and len(choices) == 1 else None
        elif not changed:
            return [frame(event, data)]
        if not out_choices:
            return []
        return [b"data: " + orjson.dumps({**chunk, "choices": out_choices}) + b"\n\n"]

    def our_calls(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls) if self.mine.get(i)]

    def all_calls(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]

    def finish(self, meta: dict[str, Any]) -> list[bytes]:
        if self.pending_finish is None:
            return []
        choice = dict(self.pending_finish)
        if self.ours and not self.theirs and choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "stop"
        elif self.pending_raw is not None:
            return [frame("", self.pending_raw)]
        chunk = {**meta, "object": "chat.completion.chunk", "choices": [choice]}
        return [b"data: " + orjson.dumps(chunk) + b"\n\n"]


def _completion(payload: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
        return None
    first = data["choices"][0]
    if not isinstance(first, dict) or not isinstance(first.get("message") or {}, dict):
        return None  # not a completion the loop can read: passed through as it came
    return data


def _drop_calls(choice: dict[str, Any], theirs: list[Any]) -> None:
    msg = dict(choice.get("message") or {})
    if theirs:
        msg["tool_calls"] = theirs
    else:
        msg.pop("tool_calls", None)
        if choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "stop"
    choice["message"] = msg


class ReadLoop(Protocol):
    """A read-tool loop for one wire format (this module's :class:`Reader` for chat
    completions, :class:`~proxy.retrieval.responses_loop.ResponsesReader`, ...). ``body`` is
    the request with the tool (:meth:`with_tool`); ``raw``, the bytes it was read from (without
    the tool): every loop sends what it did not change byte for byte (:class:`Encoder`);
    ``binding``, the request's preserved-thinking state (Messages only; the others ignore it)."""

    def needed(self, messages: Sequence[Any]) -> bool: ...

    def with_tool(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def non_stream(
        self, send: Send, body: dict[str, Any], url: URL, headers: list[tuple[str, str]],
        extra: Headers, identity: Identity, tap: Callable[[bytes], None],
        on_status: OnStatus = None, settled: Settled = None, finish: Finish = None,
        raw: bytes | None = None, binding: Binding | None = None,
    ) -> Rounds: ...

    async def stream(
        self, send: Send, body: dict[str, Any], url: URL, headers: list[tuple[str, str]],
        extra: Headers, identity: Identity, tap: Callable[[bytes], None],
        on_status: OnStatus = None, settled: Settled = None, finish: Finish = None,
        raw: bytes | None = None, binding: Binding | None = None,
    ) -> Rounds: ...
