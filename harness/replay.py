"""A replayed agent session for scale-out tests and benchmarks: a model that answers from the
history alone (so any replica, any order, any retry gets the same answer) and an agent that
resends its whole history every turn. Tool outputs of 1-6 KB (about half are offloaded), a read
of an offloaded file every ``READ_EVERY`` steps (checked against the original), compactions in
a small window.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from proxy.compaction.prompt import SECTIONS, SYSTEM_PROMPT
from proxy.demo.fake.own_calls import instructions_of
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.truncation.cut import read_chunk
from proxy.truncation.notice import parse_notice

__all__ = ["FINAL", "MODEL", "RECENT_MAX", "TOOLS", "WINDOW", "Agent", "Model", "forwarded",
           "output"]

MODEL = "scale-model"
WINDOW = 9_000
RECENT_MAX = 3000
READ_TOOL = "read_offloaded"
STEPS = 14
READ_EVERY = 4
SUMMARY = "\n".join(f"{h}\n- replay: {h.strip('# ').lower()}" for h in SECTIONS) + "\n"
FINAL = "All steps done."
RID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
DAY = re.compile(rb"dialog/\d{4}-\d{2}-\d{2}\.jsonl")  # runs may straddle midnight (UTC)
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "bash",
                                           "parameters": {"type": "object", "properties": {}}}}]


def output(sid: str, i: int) -> str:
    """Step ``i``'s tool output: 1-6 KB, so about half are offloaded."""
    size = 1000 + (i * 2371) % 5000
    lines = [f"[{sid}] step {i}"]
    while sum(len(x) + 1 for x in lines) < size:
        lines.append(f"step {i} line {len(lines)}: value={(i * 7919 + len(lines) * 104729) % 10**9}")
    return "\n".join(lines) + "\n"


def newest_step(msgs: list[dict[str, Any]]) -> int:
    for m in reversed(msgs):
        cid = m.get("tool_call_id")
        if m.get("role") == "tool" and isinstance(cid, str) and cid.startswith("call_"):
            return int(cid.removeprefix("call_"))
    return -1


@dataclass
class Model:
    """Answers from the history alone (any replica, any retry: the same answer)."""

    steps: int = STEPS
    summaries: int = 0
    reads: int = 0
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, body: dict[str, Any]) -> Reply:
        msgs: list[dict[str, Any]] = body.get("messages") or []
        if instructions_of(body) == SYSTEM_PROMPT:
            with self.lock:
                self.summaries += 1
            return Reply(content=SUMMARY)
        sid = str(msgs[0].get("content", "")).rsplit(" ", 1)[-1]
        last = msgs[-1]
        n = newest_step(msgs)
        if last.get("role") == "tool" and str(last.get("tool_call_id")).startswith("read_"):
            self._check_read(sid, msgs)
        elif last.get("role") == "tool" and n % READ_EVERY == READ_EVERY - 1:
            target = self._notice(msgs)
            if target is not None:
                return Reply(content=None, tool_calls=[{
                    "id": f"read_{n:03d}", "name": READ_TOOL,
                    "arguments": {"file_path": target, "start_line": 1}}])
        if n + 1 >= self.steps:
            return Reply(content=FINAL)
        return Reply(content=None, tool_calls=[
            {"id": f"call_{n + 1:03d}", "name": "bash",
             "arguments": {"cmd": f"step {n + 1} of {sid}"}}])

    @staticmethod
    def _notice(msgs: list[dict[str, Any]]) -> str | None:
        for m in reversed(msgs):
            content = m.get("content")
            if m.get("role") == "tool" and isinstance(content, str):
                notice = parse_notice(content)
                if notice is not None and notice.tool == READ_TOOL:
                    return notice.file_path
        return None

    def _check_read(self, sid: str, msgs: list[dict[str, Any]]) -> None:
        """The read tool (run by whichever replica) returned the original's first chunk."""
        with self.lock:
            self.reads += 1
        path = orjson.loads(msgs[-2]["tool_calls"][0]["function"]["arguments"])["file_path"]
        for m in msgs:
            content = m.get("content")
            if m.get("role") == "tool" and isinstance(content, str):
                notice = parse_notice(content)
                if notice is not None and notice.file_path == path:
                    i = int(str(m["tool_call_id"]).removeprefix("call_"))
                    want = read_chunk(output(sid, i), 1, 0, RECENT_MAX, file_path=path,
                                      tool=READ_TOOL)
                    if msgs[-1].get("content") != want:
                        self.problems.append(f"{sid}: read of {path} got "
                                             f"{str(msgs[-1].get('content'))[:120]!r}")
                    return
        self.problems.append(f"{sid}: read of {path}, which no notice names")


@dataclass
class Agent:
    """Resends its whole history every turn; retries a turn the balancer could not complete
    (the replica serving it was killed), as agents retry failed calls."""

    sid: str
    history: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    retries: int = 0
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history = [{"role": "system", "content": f"You are a replayed agent {self.sid}"},
                        {"role": "user", "content": f"Run every step, session {self.sid}."}]

    def run(self, url: str, *, retry: bool = False, on_turn: Any = None) -> None:
        headers = {"x-session-id": self.sid, "content-type": "application/json"}
        with httpx.Client(timeout=60) as http:
            for turn in range(100):
                body = orjson.dumps({"model": MODEL, "messages": self.history, "tools": TOOLS})
                while True:
                    try:
                        r = http.post(url + "/v1/chat/completions", content=body,
                                      headers=headers)
                        if r.status_code == 200:
                            break
                        problem = f"turn {turn}: {r.status_code} {r.text[:200]}"
                    except httpx.TransportError as exc:
                        problem = f"turn {turn}: {exc!r}"
                    if not retry:
                        self.failures.append(problem)
                        return
                    self.retries += 1
                    time.sleep(0.1)
                msg = r.json()["choices"][0]["message"]
                self.answers.append(msg)
                self.history.append(msg)
                if on_turn is not None:
                    on_turn(turn)
                calls = msg.get("tool_calls") or []
                for call in calls:
                    i = int(call["id"].removeprefix("call_"))
                    self.history.append({"role": "tool", "tool_call_id": call["id"],
                                         "content": output(self.sid, i)})
                if not calls:
                    return


def forwarded(fake: FakeUpstream, sid: str) -> list[bytes]:
    """The bodies the upstream got for one session (model and summarizer calls), in order,
    with the session's own name, ids and archive day made generic."""
    marker = sid.encode()
    return [DAY.sub(b"dialog/DAY.jsonl", RID.sub(b"RID", r.body)).replace(marker, b"SID")
            for r in fake.received
            if r.path.endswith("/chat/completions") and marker in r.body]
