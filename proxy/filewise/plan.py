"""File-aware forms of tool results: which results a request forwards as a superseded/stale
marker, a re-read delta or a reference to a duplicate (docs/file-aware.md).

The rules are :mod:`.rereads` and :mod:`.dedupe` (pure); this module decides, for one history
in one epoch, which of them applies to which result, in history order, in the order of
precedence the offload stage gives them:

1. a result a ``protect`` policy covers, one before the provider's compaction item, or one the
   summary replaced: untouched here;
2. a read in ``history[:seen]`` that is superseded or stale at this epoch (``seen``: where the
   epoch began; :func:`.rereads.superseded`, decided on ``history[:seen]`` alone): its marker;
3. a result stage 2 ages: left to stage 2;
4. a read arriving in this epoch that repeats an earlier read (same tool, file and range)
   still forwarded whole: a delta against it when that is at most half its size
   (:func:`.delta.delta_text`); else an output repeating (spans of) earlier outputs still
   forwarded whole: references to them (:func:`.dedupe.duplicate`), for a read only when it
   arrived in this epoch (at an epoch's start a read before it is verbatim or a marker). Both compare the *bodies*, the client's envelope aside
   (:mod:`.envelope`: Claude Code's reminders, Codex's exec header), and forward the new body's
   form inside the result's own envelope; Claude Code's ``Read`` line numbers (``12\\t``) are
   left out of a diff, as an inserted line would change every line after it (the hunk headers
   carry the numbers).

A result is *whole* for rule 4 when nothing here or in the stages cuts or replaces it. Each
decision depends on ``history[:i + 1]`` and the epoch (``seen`` and what the epoch's start
decided for ``history[:seen]``) alone, so within an epoch the forwarded history only grows
(:mod:`.epoch`), and decisions are kept per session and epoch, by each result's chain: a
resent history costs a dictionary probe per result. Every original is kept by the caller (the
offload stage's effects), as for any cut.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from proxy.config.offload import OffloadConfig, ToolPolicy
from proxy.filewise.dedupe import DedupIndex, Earlier
from proxy.filewise.delta import delta_text, parse_delta
from proxy.filewise.envelope import split_envelope
from proxy.filewise.markers import PREFIX, Pointer
from proxy.filewise.provenance import CallCache, Provenance, provenance
from proxy.filewise.rereads import (
    Rereads,
    Supersession,
    marker,
    parse_marker,
    superseded,
    turns_upto,
)
from proxy.history.turns import RESULT_ROLES
from proxy.lru import LRU
from proxy.model import Message, RequestView, result_text
from proxy.truncation.notice import parse_notice, utf8_len
from proxy.work import DEFAULT_BUDGET, Work

__all__ = ["MARK_MIN_BYTES", "FileForms", "Form", "plain_lines"]

#: A read smaller than this is never replaced by a marker (a marker is ~250 bytes: below
#: twice that, it would save too little for what it hides).
MARK_MIN_BYTES: Final = 512
# Claude Code's Read output: every line ``N\t...`` (older versions pad N, or use ``→``).
_NUMBERED: Final = re.compile(r" *([0-9]+)[\t\u2192]")


@dataclass(frozen=True, slots=True)
class Form:
    """A result's file-aware form: ``kind`` ("superseded", "stale", "unchanged", "delta",
    "duplicate") and the text forwarded in its place."""

    kind: str
    text: str


def plain_lines(body: str) -> tuple[int, str] | None:
    """A body of consecutively numbered lines (Claude Code's ``Read``) as its first number and
    the lines without their numbers; None when it is not one."""
    lines = body.split("\n")
    out: list[str] = []
    first = expected = -1
    for line in lines:
        if line == "" and len(out) == len(lines) - 1:
            out.append("")  # a trailing newline
            break
        m = _NUMBERED.match(line)
        if m is None:
            return None
        n = int(m[1])
        if first < 0:
            first = expected = n
        if n != expected:
            return None
        expected += 1
        out.append(line[m.end():])
    return (first, "\n".join(out)) if first >= 0 else None


_EpochKey = tuple[str, str, int, str, int]
# What a decision or a mark costs besides a form's text: its chain (a 32-byte hex key), the
# tuple, the Form, the dict slot; a Supersession with its strings.
_DECISION = 200
_MARK = 600


def _memo_size(memo: Mapping[str, tuple[Form | None, int]]) -> int:
    return 64 + sum(_DECISION + (len(f.text) if f is not None else 0) for f, _ in memo.values())


@dataclass(slots=True)
class _State:
    """What deciding the results of one history takes, built at its first undecided result:
    its provenance, the re-read and duplicate indices (fed the results found whole, in
    history order), each result's turn, the bodies split from their envelopes."""

    prov: Provenance
    rereads: Rereads
    turns: list[int]
    dedupe: DedupIndex
    bodies: dict[int, str]
    work: Work | None
    fed: int = 0  # how many of the whole results the indices were told of
    marks: Mapping[int, Supersession] | None = None  # the epoch's superseded reads

    def catch_up(self, history: Sequence[Message], order: Sequence[int],
                 whole: Mapping[int, bool]) -> None:
        """Tell the indices of the results found whole since the last call."""
        for j in order[self.fed:]:
            if not whole.get(j):
                continue
            self.rereads.whole(j)
            body = FileForms._body(history, j, self.bodies)
            self.dedupe.add(Earlier(j, _call_id(history[j]), self.turns[j], body))
        self.fed = len(order)


class FileForms:
    """The file-aware forms of a session's results, per epoch (one instance per process: its
    caches are bounded)."""

    def __init__(self, config: OffloadConfig, *, cache_bytes: int = 48 * 1024 * 1024) -> None:
        self.config = config
        self.enabled = config.supersede_reads or config.reread_deltas or config.dedupe
        # A third each: the calls' parses, the decisions, the epochs' superseded reads; each
        # sized by what its entries pin (a decision holds its form's text).
        self.calls = CallCache(config.read_tools, cache_bytes // 3)
        # (tenant, session, seen, chain at seen, first) -> a result's chain -> its form
        self._epochs: LRU[_EpochKey, dict[str, tuple[Form | None, int]]] = LRU(
            cache_bytes // 3, lambda _, memo: _memo_size(memo))
        self._marks: LRU[_EpochKey, Mapping[int, Supersession]] = LRU(
            cache_bytes // 3, lambda _, marks: 64 + _MARK * len(marks))

    def undecided(self, history: Sequence[Message], request: RequestView, *, seen: int,
                  first: int) -> bool:
        """Whether, in the epoch that began at ``seen``, some result of ``history`` big enough
        for a rule is not decided yet (the caller moves a large request's stage off the event
        loop for it: an epoch's start decides every result again)."""
        chains = request.chains
        if not self.enabled or len(chains) != len(history) or not history:
            return False
        memo = self._epochs.get(self._key(request, seen, first)) or {}
        for i, m in enumerate(history):
            if i >= first and m.get("role") in RESULT_ROLES and chains[i] not in memo:
                text = result_text(m.get("content"))
                if text is not None and 4 * len(text) >= MARK_MIN_BYTES:
                    return True
        return False

    @staticmethod
    def _key(request: RequestView, seen: int, first: int) -> _EpochKey:
        # What the epoch's decisions depend on besides each result's own prefix: where the
        # epoch began (its history, by the chain there: ageing, quote protection and the
        # superseded reads are functions of it) and the first result the rules may touch.
        chains = request.chains
        return (request.identity.tenant, request.identity.session, seen,
                chains[seen - 1] if 0 < seen <= len(chains) else "", first)

    def plan(
        self,
        history: Sequence[Message],
        request: RequestView,
        *,
        seen: int,
        first: int,
        policies: Mapping[int, ToolPolicy],
        aged: Callable[[int], bool],
        stays_whole: Callable[[int, str], bool],
        saved: Callable[[str], Pointer],
    ) -> dict[int, Form]:
        """History index -> form, for the results that get one. ``seen``: where the epoch
        began (0: before any); ``first``: the first result these rules may touch (before it:
        replaced by the summary, or behind the provider's compaction item); ``aged(i)``:
        stage 2 re-cuts result i; ``stays_whole(i, text)``: the stages leave result i whole
        (it fits its budget); ``saved(text)``: where the caller keeps an original.

        The work budget (``request.work``, :mod:`.work`): each decision costs the characters
        of the result and of the earlier output it is compared with, counted over the epoch in
        history order (kept with each decision); a result whose count passes the budget, and
        every later one in the epoch, gets no form (stage 1 cuts it as without these rules).
        The count is a function of ``history[:i + 1]`` and the epoch, as every decision is:
        a request that degrades and the next one, or a replica deciding again, agree."""
        chains = request.chains
        if not self.enabled or len(chains) != len(history) or not history:
            return {}
        work = request.work
        budget = work.budget if work is not None else DEFAULT_BUDGET
        key = self._key(request, seen, first)
        memo = self._epochs.get(key)
        known = 0 if memo is None else len(memo)
        if memo is None:
            memo = {}
        state: _State | None = None
        whole: dict[int, bool] = {}
        order: list[int] = []  # the results found whole, in history order
        forms: dict[int, Form] = {}
        spent = 0  # the epoch's count through the last result decided
        for i, m in enumerate(history):
            if i < first or m.get("role") not in RESULT_ROLES:
                continue
            text = result_text(m.get("content"))
            if text is None:
                continue
            policy = policies.get(i)
            if policy is not None and policy.protect:
                whole[i] = True
                order.append(i)
                continue
            if _forwarded_form(text):
                whole[i] = False  # a client that stored our forwarded text: left as it is
                continue
            found = memo.get(chains[i])
            if found is not None:
                form, spent = found
            else:
                if work is not None:
                    work.spend(len(text))
                if spent + len(text) > budget:
                    form, spent = None, spent + len(text)
                    if work is not None:
                        work.degrade("filewise")
                else:
                    if state is None:
                        state = self._state(history, request)
                    state.catch_up(history, order, whole)
                    form, extra = self._decide(history, request, i, text, state, seen, key,
                                               policy, aged, whole, saved)
                    spent += len(text) + extra
                memo[chains[i]] = (form, spent)
            if form is not None:
                forms[i] = form
            whole[i] = form is None and not aged(i) and stays_whole(i, text)
            if whole[i]:
                order.append(i)
        if len(memo) != known or known == 0:
            self._epochs.put(key, memo)  # (again: its size is what it pins now)
        return forms

    def _state(self, history: Sequence[Message], request: RequestView) -> _State:
        work = request.work
        if work is not None:
            work.spend(len(history))
        prov = provenance(history, self.config.read_tools, cache=self.calls)
        turns = turns_upto(history, len(history))
        return _State(prov, Rereads(history, prov, turns), turns, DedupIndex(
            min_bytes=self.config.dedupe_min_bytes), {}, work)

    def _decide(
        self, history: Sequence[Message], request: RequestView, i: int, text: str,
        state: _State, seen: int, key: _EpochKey, policy: ToolPolicy | None,
        aged: Callable[[int], bool], whole: Mapping[int, bool],
        saved: Callable[[str], Pointer],
    ) -> tuple[Form | None, int]:
        """Result ``i``'s form and the extra count its decision costs (the characters of the
        earlier output it was compared with)."""
        c = self.config
        prov = state.prov
        if i < seen and c.supersede_reads and utf8_len(text) >= MARK_MIN_BYTES:
            # Kept by the request too: marks too large for the cache are made once a request,
            # not once a result.
            marks = state.marks if state.marks is not None else self._marks.get(key)
            if marks is None:
                if state.work is not None:
                    state.work.spend(len(prov.reads) + len(prov.edits))
                marks = superseded(history, prov, seen)
                self._marks.put(key, marks)
            state.marks = marks
            found = marks.get(i)
            if found is not None:
                return Form(found.kind, marker(found, saved=saved(text))), 0
        if aged(i) or (policy is not None and not policy.dedupe):
            return None, 0
        # Before the epoch's start a read is verbatim or a marker: a delta is an arrival's form
        # (the next epoch forwards the newest read of each file whole), and neither is a read
        # forwarded as a reference to a copy.
        if i < seen and state.rereads.reads(i):
            return None, 0
        envelope = split_envelope(text)
        body = envelope.body
        extra = 0
        if c.reread_deltas:
            again = state.rereads.find(i)
            if again is not None:
                base = self._body(history, again.base_index, state.bodies)
                extra += len(base)
                if state.work is not None:
                    state.work.spend(len(base))
                old, new = base, body
                numbered_old, numbered_new = plain_lines(base), plain_lines(body)
                if (numbered_old is not None and numbered_new is not None
                        and numbered_old[0] == numbered_new[0]):
                    old, new = numbered_old[1], numbered_new[1]
                delta = delta_text(old, new, path=again.read.path, base_call=again.base.call_id,
                                   base_turn=again.base_turn, saved=saved(text))
                if delta is not None:
                    kind = "unchanged" if old == new else "delta"
                    return Form(kind, envelope.wrap(delta)), extra
        if c.dedupe and utf8_len(body) >= c.dedupe_min_bytes:
            index = state.dedupe
            before = index.spent
            found_dup = index.duplicate(body, saved=saved(text))
            if state.work is not None:
                state.work.spend(index.spent - before)
            if found_dup is not None:
                return Form("duplicate", envelope.wrap(found_dup.text)), extra
        return None, extra

    @staticmethod
    def _body(history: Sequence[Message], j: int, bodies: dict[int, str]) -> str:
        found = bodies.get(j)
        if found is None:
            found = split_envelope(result_text(history[j].get("content")) or "").body
            bodies[j] = found
        return found

    def forget(self) -> None:
        self._epochs.clear()
        self._marks.clear()


def _call_id(message: Message) -> str:
    cid = message.get("tool_call_id")
    return cid if isinstance(cid, str) else ""


def _forwarded_form(text: str) -> bool:
    """Whether ``text`` is a form the proxy forwards (a client that keeps the forwarded text
    sends it back): a notice, a marker, a delta."""
    if parse_notice(text) is not None or parse_marker(text) is not None:
        return True
    body = split_envelope(text).body
    return parse_delta(body) is not None or body.startswith(PREFIX) or "\n" + PREFIX in body
