"""Preserved thinking: recovering from Anthropic's prefix check (``/v1/messages`` only).

Anthropic binds each signed ``thinking``/``redacted_thinking`` block to the prefix it was made
with (``system``, ``tools``, the earlier messages). A request whose prefix changed since is
refused with a 400 saying the block "is bound to a different conversation". The API's own way
out: the beta header :data:`BETA` and ``thinking.block_binding.prefix_mismatch_behavior`` set
to ``"drop_block"``, upon which it drops the invalid blocks and answers. The setting is not
stored upstream: every later request of the conversation must carry it.

A request that the client would have got through directly must not fail through the proxy
(whose compaction and ageing change the prefix), so:

* :meth:`Binding.send` posts a request and, when the answer is that 400 and the request carries
  thinking blocks, posts it once more with ``drop_block`` and the beta header: only the
  ``thinking`` member of the body is replaced (:func:`proxy.formats.json.splice`), every other
  member is the forwarded bytes (signed blocks are never re-serialised). The client gets the
  retry's answer as the provider gave it, whatever it is. A client that set ``block_binding``
  itself is never retried (its choice).
* :class:`ThinkingBindings` remembers the sessions that needed it, in the process and in the
  store's session index (shared by replicas on PostgreSQL), once a retry was accepted (a
  provider refusing the beta must not see it on every request): their later requests carry
  ``drop_block`` from the start. The flag comes with the session row the archive reads when it
  records a request's new messages (no query of its own); otherwise the store is asked at most
  once per session every ``recheck_s``, and only for requests that carry thinking blocks. A
  ``True`` is kept for good.

An answer to a retried request has ``x-ctxproxy-thinking: dropped``; one sent with
``drop_block`` from the start because of the session's memory, ``x-ctxproxy-thinking:
drop_block``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import aiohttp
import orjson
from yarl import URL

from proxy import rawjson as json
from proxy.background import Background
from proxy.lru import LRU
from proxy.metrics import Metrics
from proxy.session import Identity
from proxy.upstream.http import Upstream
from proxy.upstream.relay import read_whole

__all__ = [
    "BETA",
    "Binding",
    "ThinkingBindings",
    "ThinkingFlags",
    "carries_blocks",
    "prefix_mismatch",
    "with_beta",
    "with_drop_block",
]

log = logging.getLogger("proxy.upstream")

BETA: Final = "thinking-binding-controls-2026-08-01"
DROP_BLOCK: Final = {"prefix_mismatch_behavior": "drop_block"}
HEADER: Final = b"x-ctxproxy-thinking"
_BLOCKS: Final = frozenset({"thinking", "redacted_thinking"})
_SIGNS: Final = ("bound to a different conversation", "prefix_mismatch_behavior")
_WHERE: Final = re.compile(r"messages\.(\d+)\.content\.(\d+)")
# An error body is small; a 400 larger than this is not read here (it passes as it came).
_MAX_ERROR_BODY: Final = 1 << 20
# From this size on the body is edited in a worker thread (as conversation.HUGE_BODY): a session
# that needs drop_block has it spliced into every request.
_HUGE_BODY: Final = 2 * 1024 * 1024


class ThinkingFlags(Protocol):
    """Where the sessions that need ``drop_block`` are kept (the store's session index)."""

    def thinking_dropped(self, tenant: str, session: str) -> bool: ...

    def mark_thinking_dropped(self, tenant: str, session: str) -> None: ...


def carries_blocks(messages: Any) -> bool:
    """Whether a Messages ``messages`` array holds a thinking or redacted_thinking block."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        content = message.get("content")
        if type(content) is list:
            for block in content:
                if type(block) is dict and block.get("type") in _BLOCKS:
                    return True
    return False


def client_binding(body: Mapping[str, Any]) -> bool:
    """Whether the client set ``thinking.block_binding`` itself."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and "block_binding" in thinking


def prefix_mismatch(status: int, payload: bytes) -> str | None:
    """The error message when ``payload`` is Anthropic's prefix-check 400, else None."""
    if status != 400:
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(message, str) and any(sign in message for sign in _SIGNS):
        return message
    return None


def with_drop_block(raw: bytes) -> bytes:
    """``raw`` with ``thinking.block_binding`` set to drop_block: the client's ``thinking``
    object keeps its other fields (none: adaptive thinking, as the API's docs say); every other
    member is copied as it was."""
    parts = json.members(raw)
    given = parts.get("thinking")
    value = orjson.loads(bytes(given)) if given is not None else None
    thinking = ({**value, "block_binding": DROP_BLOCK} if isinstance(value, dict)
                else {"type": "adaptive", "block_binding": DROP_BLOCK})
    return json.splice(parts, {"thinking": json.dumps(thinking)})


def with_beta(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The request headers with :data:`BETA` among the ``anthropic-beta`` values: the client's
    own values kept, in order, comma-separated in one header where the first one was."""
    values: list[str] = []
    out: list[tuple[str, str]] = []
    at: int | None = None
    for name, value in headers:
        if name.lower() == "anthropic-beta":
            values += [v.strip() for v in value.split(",") if v.strip()]
            if at is None:
                at = len(out)
                out.append((name, ""))
            continue
        out.append((name, value))
    merged = ",".join(dict.fromkeys([*values, BETA]))
    if at is None:
        out.append(("anthropic-beta", merged))
    else:
        out[at] = (out[at][0], merged)
    return out


class ThinkingBindings:
    """Which sessions need ``drop_block``: a bounded in-process map in front of the store's
    flags (None: this process only). Built by the app's lifespan."""

    def __init__(
        self, flags: ThinkingFlags | None, metrics: Metrics, background: Background, *,
        limit: int = 100_000, recheck_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.flags = flags
        self.metrics = metrics
        self.background = background
        self.recheck_s = recheck_s
        self.clock = clock
        # (tenant, session) -> (needs drop_block, until when that answer holds)
        self._known: LRU[tuple[str, str], tuple[bool, float]] = LRU(limit)

    def binding(
        self, identity: Identity, body: Mapping[str, Any], *, persist: bool = True,
        stored: bool | None = None,
    ) -> Binding:
        """One request's binding state. ``persist`` off (a tenant over its quota): a recovery is
        remembered in this process only. ``stored``: the session's flag as the archive just
        read it with the session row (None: not read), so no read of its own is needed."""
        if stored is not None:
            self.learn(identity, stored)
        return Binding(self, identity, client_set=client_binding(body),
                       blocks=lambda: carries_blocks(body.get("messages")), persist=persist)

    def learn(self, identity: Identity, stored: bool) -> None:
        """The store's flag, read elsewhere; a ``True`` this process knows is kept (it may
        not be stored: a tenant over its quota, a store that failed)."""
        key = (identity.tenant, identity.session)
        if stored:
            self._known.put(key, (True, math.inf))
        elif not (self._known.get(key) or (False, 0.0))[0]:
            self._known.put(key, (False, self.clock() + self.recheck_s))

    def known(self, identity: Identity) -> bool | None:
        """What this process knows of the session (None: nothing, or it is time to ask)."""
        hit = self._known.get((identity.tenant, identity.session))
        if hit is not None and (hit[0] or hit[1] > self.clock()):
            return hit[0]
        return None

    async def needed(self, identity: Identity) -> bool:
        known = self.known(identity)
        if known is not None:
            return known
        key = (identity.tenant, identity.session)
        now = self.clock()
        found = False
        if self.flags is not None:
            try:
                found = await asyncio.to_thread(self.flags.thinking_dropped, *key)
            except Exception as exc:  # the store is a shortcut here: the retry still recovers
                log.warning("thinking flag of session %s not read: %s", identity.session, exc)
        self._known.put(key, (found, math.inf if found else now + self.recheck_s))
        return found

    def remember(self, identity: Identity, *, persist: bool) -> None:
        key = (identity.tenant, identity.session)
        self._known.put(key, (True, math.inf))
        if persist and self.flags is not None:
            self.background.spawn(self._save(key))

    async def _save(self, key: tuple[str, str]) -> None:
        assert self.flags is not None
        try:
            await asyncio.to_thread(self.flags.mark_thinking_dropped, *key)
        except Exception as exc:  # best effort: another replica recovers by itself
            log.warning("thinking flag of session %s not saved: %s", key[1], exc)


class Binding:
    """One request's (or one read loop's) binding state: whether ``drop_block`` goes out, and
    whether a prefix-check 400 is retried. Once on, it stays on for every later round."""

    def __init__(
        self, bindings: ThinkingBindings, identity: Identity, *, client_set: bool,
        blocks: Callable[[], bool], persist: bool,
    ) -> None:
        self.bindings = bindings
        self.identity = identity
        self.client_set = client_set
        self.blocks = blocks
        self.persist = persist
        self.active = False  # drop_block is sent
        self.retried = False  # a request was sent again with drop_block
        self._checked = False

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The response header saying what was done (none when nothing was)."""
        if self.retried:
            return [(HEADER, b"dropped")]
        if self.active:
            return [(HEADER, b"drop_block")]
        return []

    async def send(
        self, upstream: Upstream, method: str, url: URL, headers: list[tuple[str, str]],
        body: bytes,
    ) -> aiohttp.ClientResponse:
        """Post ``body``; on the prefix-check 400, post it once more with drop_block. The
        response returned has its body unread, or read and kept (aiohttp caches it) when it is
        a 400 that is passed on."""
        if self.client_set:
            return await upstream.send(method, url, headers, body)
        if not self._checked:
            self._checked = True
            # The history is scanned only when the session may need drop_block, and the store
            # asked only for a request with thinking blocks (the check cannot concern others).
            known = self.bindings.known(self.identity)
            if known is None:
                self.active = self.blocks() and await self.bindings.needed(self.identity)
            else:
                self.active = known and self.blocks()
        if self.active:
            return await upstream.send(method, url, with_beta(headers), await _dropping(body))
        resp = await upstream.send(method, url, headers, body)
        if (resp.status != 400 or self.retried or resp.content_type != "application/json"
                or (resp.content_length or 0) > _MAX_ERROR_BODY):
            return resp
        message = prefix_mismatch(resp.status, await read_whole(resp))
        if message is None or not self.blocks():
            return resp
        resp.release()
        where = _WHERE.search(message)
        log.warning("thinking block bound to another prefix (session %s, messages.%s.content.%s):"
                    " sent again with drop_block", self.identity.session,
                    where.group(1) if where else "?", where.group(2) if where else "?")
        self.bindings.metrics.thinking_dropped.inc()
        self.active = self.retried = True
        again = await upstream.send(method, url, with_beta(headers), await _dropping(body))
        if again.status < 300:
            # Only an accepted drop_block is remembered: a provider refusing the beta must not
            # see it on every later request of the session.
            self.bindings.remember(self.identity, persist=self.persist)
        return again


async def _dropping(body: bytes) -> bytes:
    if len(body) >= _HUGE_BODY:
        return await asyncio.to_thread(with_drop_block, body)
    return with_drop_block(body)
