"""Hostile requests, for the fuzz tests (``tests/test_fuzz.py``) and the fuzz bench
(``bench/fuzz.py``): generators, a model that answers with hostile read-tool calls, and the
checks an answer must pass.

Two kinds of generator, both seeded (case ``i`` of seed ``s`` is the same bytes on every run):

* :class:`Gen`: chat-completions request *bytes* from nothing: wrong types, missing fields, huge
  strings, deep nesting (on both sides of the limits of the JSON parser and serializer),
  invalid UTF-8 and lone surrogates in ``\\u`` escapes, unknown roles, tool messages without
  calls, calls without results, content part lists of every shape, forged truncation notices
  and summaries (which switch on the read-tool loop), odd headers.
* :class:`Mutator`: one to three structure-aware mutations of a *realistic* body of a format
  (:func:`seeds`: Claude Code's and Codex's requests as recorded in
  ``tests/fixtures/provenance/``, with the system prompt and tool schemas those CLIs send put
  back, and a chat-completions conversation of the same calls): a value of another JSON type
  where a field was, a block ``type`` or a ``role`` that is an object, a list or another word,
  a call id swapped for another call's (orphans, unanswered calls), items dropped, duplicated
  or moved, a value from elsewhere in the body put in (a message where a block goes), unknown
  fields, a huge tool output (offload), then sometimes :class:`Gen`'s byte-level damage.

:func:`judge` says what is wrong with one answer: a proxy-made 5xx (the fake upstream never
answers one), an error outside its route's envelope (OpenAI's, Anthropic's for
``/v1/messages``), a stream that does not end as its format ends one.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from proxy.compaction.message import SUMMARY_HEADING
from proxy.compaction.prompt import SECTIONS, SYSTEM_PROMPT
from proxy.demo.fake.upstream import Reply
from proxy.truncation.notice import MARKER

__all__ = [
    "ENVELOPE_KEYS",
    "FIXTURES",
    "FORMATS",
    "MAX_BODY_MB",
    "READ_TOOL",
    "TINY",
    "Case",
    "Crashes",
    "Gen",
    "Mutator",
    "Verdict",
    "cases",
    "envelope_ok",
    "hostile_responder",
    "judge",
    "responder",
    "seeds",
]

STRESS = os.environ.get("CTXPROXY_STRESS") == "1"
MAX_BODY_MB = 4
PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYPj/HwADAgH/pUPIZwAAAABJRU5ErkJggg==")
READ_TOOL = "read_offloaded"

# Placeholders put into generated strings, replaced in the serialized bytes by what orjson would
# never write itself.
_SURR = "@@SURR@@"
_BYTES = "@@BYTES@@"
_DEEP = "@@DEEP@@"
_NUM = "@@NUM@@"
_NUMBERS = [b"18446744073709551616", b"18446744073709551615", b"-9223372036854775809", b"1e400",
            b"123456789012345678901234567890", b"1E-400", b"-0", b"0.0000000000000000000000000001"]
_ESCAPES = [b"\\ud800", b"\\udfff", b"\\ud83d", b"\\ude00", b"\\ud83d\\u0041", b"\\ud83d\\ude00",
            b"\\u0000", b"\\u00", b"\\uZZZZ", b"\\x41", b"\\", b"\\ud800\\ud800", b"\\uDBFF\\uDFFF"]
_INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                 b"\x80", b"\xc3", b"\xf0\x9f\x98", b"\x00"]
_ROLES = ["system", "developer", "user", "assistant", "tool", "function"]
_ODD_ROLES: list[Any] = ["", "nope", "USER", "ipython", None, 5, True, [], {}, "tool\x00", "user "]
_PART_TYPES = ["text", "image_url", "input_audio", "file", "refusal", "input_text", "image", "x", "",
               None, 3]


def _notice(path: str, next_line: Any = 3) -> str:
    return (f"line one\nline two\n{MARKER}\nThe output above was truncated.\n"
            "The full content is saved to the file and contains 10 lines in total.\n"
            "This excerpt starts at line 1 and covers the next 18 bytes.\n"
            f"If the current content is not enough, call `{READ_TOOL}` with file_path={path} "
            f"start_line={next_line} to read more.")


_HOSTILE_PATHS: list[Any] = [
    "tool_result/00000000-0000-0000-0000-000000000000.txt", "dialog/2020-01-01.jsonl",
    "../../../../etc/passwd", "/etc/passwd", "tool_result/../../x.txt", "tool_result/%2e%2e.txt",
    "dialog/../../../_index.sqlite3", "_index.sqlite3", "tool_result/\x00.txt", "x" * 5000, "", None,
    5, ["tool_result/a.txt"], {"p": 1}, "tool_result\\..\\..\\x.txt", "dialog/9999-99-99.jsonl",
    "TOOL_RESULT/00000000-0000-0000-0000-000000000000.txt", "tool_result/.txt",
]


class Gen:
    """One request's worth of hostile input, from a seeded generator."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def text(self, limit: int = 60) -> str:
        r = self.r
        pick = r.random()
        if pick < 0.5:
            return "".join(r.choice("abc xyz\n\t{}[]\"'\\/<>&") for _ in range(r.randint(0, limit)))
        if pick < 0.7:
            return "".join(chr(r.choice([r.randint(32, 126), r.randint(0x80, 0x7FF),
                                         r.randint(0x800, 0xD7FF), r.randint(0xE000, 0xFFFF),
                                         r.randint(0x10000, 0x10FFFF), r.randint(0, 31)]))
                           for _ in range(r.randint(0, limit)))
        if pick < 0.8:
            return r.choice([_SURR, _BYTES, f"a{_SURR}b", f"x{_BYTES}y"])
        if pick < 0.85:
            return r.choice(["../../../etc/passwd", "..", "/", "\x00", "con", "a" * 200, "é" * 70])
        if pick < 0.9:
            return MARKER if self.chance(0.5) else SUMMARY_HEADING
        return ""

    def big_text(self) -> str:
        r = self.r
        size = r.choice([60_000, 120_000, 300_000]) if not self.chance(0.1) else r.choice(
            [1_500_000, MAX_BODY_MB * 1024 * 1024 + 10])
        line = r.choice(["x" * 79 + "\n", "Traceback (most recent call last):\n", "é" * 40 + "\n",
                         "no newline at all " * 5, "\r\n", "\x00\x01\x02\n"])
        return (line * (size // len(line) + 1))[:size]

    def scalar(self) -> Any:
        r = self.r
        return r.choice([None, True, False, 0, -1, 2**63 - 1, -(2**63), 1.5, -0.0, 1e308,
                         self.text(20), "", [], {}, _NUM])

    def value(self, depth: int = 0) -> Any:
        if depth > 3 or self.chance(0.5):
            return self.scalar()
        if self.chance(0.5):
            return [self.value(depth + 1) for _ in range(self.r.randint(0, 3))]
        return {self.text(8): self.value(depth + 1) for _ in range(self.r.randint(0, 3))}

    def deep(self) -> bytes:
        """Raw JSON nested around the serializer's (255) and the parser's (1024) depth limits."""
        n = self.r.choice([10, 100, 127, 128, 129, 200, 253, 254, 255, 256, 300, 1000, 1023, 1024,
                           1025, 5000])
        if self.chance(0.5):
            return b"[" * n + b"]" * n
        return b'{"a":' * n + b"1" + b"}" * n

    def url(self) -> Any:
        r = self.r
        return r.choice([f"data:image/png;base64,{PIXEL}", "data:image/png;base64,!!!not base64",
                         "data:image/png;base64," + base64.b64encode(os.urandom(64)).decode(),
                         "data:,", "data:image/svg+xml;base64,PHN2Zz4=", "https://example.com/x.png",
                         "", None, 5, {"url": "x"}, "data:image/png;base64," + "A" * 10_000])

    def part(self) -> Any:
        r = self.r
        if self.chance(0.1):
            return self.value()
        kind = r.choice(_PART_TYPES)
        part: dict[str, Any] = {"type": kind} if not self.chance(0.05) else {}
        if kind == "text" or self.chance(0.2):
            part["text"] = self.text() if self.chance(0.8) else self.value()
        if kind in ("image_url", "image") or self.chance(0.1):
            part["image_url"] = ({"url": self.url(), "detail": r.choice(["low", "high", "auto", 7,
                                                                         None, "x"])}
                                 if self.chance(0.8) else self.url())
        if kind == "input_audio":
            part["input_audio"] = r.choice([{"data": "AAAA", "format": "wav"}, {}, "x", None])
        if kind == "file":
            part["file"] = r.choice([{"file_data": "data:application/pdf;base64,JVBERi0=",
                                      "filename": "a.pdf"}, {"file_id": "file-1"}, {}, None])
        if kind == "refusal":
            part["refusal"] = self.text()
        return part

    def content(self, tool: bool = False) -> Any:
        r = self.r
        pick = r.random()
        if tool and pick < 0.3:
            text = self.big_text()
            return text if self.chance(0.7) else [{"type": "text", "text": text}]
        if pick < 0.45:
            return self.text(200)
        if pick < 0.55:
            return None
        if pick < 0.8:
            return [self.part() for _ in range(r.randint(0, 4))]
        if pick < 0.85:
            return _notice(r.choice([p for p in _HOSTILE_PATHS if isinstance(p, str)]),
                           r.choice([3, 0, -5, "x", 10**12]))
        if pick < 0.88:
            return f"{SUMMARY_HEADING}\n{self.text()}"
        return self.value()

    def call(self, cid: Any) -> Any:
        r = self.r
        if self.chance(0.08):
            return self.value()
        call: dict[str, Any] = {"id": cid, "type": r.choice(["function", "function", "custom", None])}
        fn: dict[str, Any] = {"name": r.choice(["bash", "read_file", "Read", "view", READ_TOOL, "",
                                                None, 5, self.text(10)])}
        args = r.choice([orjson.dumps({"cmd": "ls"}).decode(), orjson.dumps({"path": "a.md"}).decode(),
                         orjson.dumps({"file_path": "/x/README.md", "offset": 3}).decode(), "{not json",
                         "", None, {"cmd": "ls"}, 5, "[]"])
        if not self.chance(0.05):
            fn["arguments"] = args
        if not self.chance(0.05):
            call["function"] = fn if not self.chance(0.05) else self.value()
        return call

    def message(self, ids: list[Any]) -> Any:
        """One message; ``ids`` holds call ids announced so far (results may answer them, or
        not, or answer ids never announced)."""
        r = self.r
        if self.chance(0.04):
            return self.value()
        role = r.choice(_ROLES) if not self.chance(0.06) else r.choice(_ODD_ROLES)
        msg: dict[str, Any] = {"role": role} if not self.chance(0.03) else {}
        if not self.chance(0.05):
            msg["content"] = self.content(tool=role in ("tool", "function"))
        if role == "assistant" and self.chance(0.5):
            calls = []
            for _ in range(r.randint(0, 3)):
                cid = r.choice([f"call_{r.randint(0, 5)}", f"call_{r.randint(0, 5)}", None, 7, "",
                                self.text(10)])
                ids.append(cid)
                calls.append(self.call(cid))
            msg["tool_calls"] = calls if not self.chance(0.05) else self.value()
        if role in ("tool", "function") or self.chance(0.05):
            if ids and self.chance(0.7):
                msg["tool_call_id"] = r.choice(ids)
            elif not self.chance(0.2):
                msg["tool_call_id"] = r.choice([f"call_{r.randint(0, 9)}", None, 5, "", self.text(10)])
        if self.chance(0.1):
            msg["name"] = r.choice(["read_file", "Read", "bash", None, 3, self.text(10)])
        if self.chance(0.05):
            msg[self.text(6)] = self.value()
        return msg

    def messages(self) -> Any:
        r = self.r
        if self.chance(0.04):
            return self.value()
        ids: list[Any] = []
        n = r.choice([0, 1, 2, 3, 4, 6, 10]) if not self.chance(0.05) else r.randint(30, 120)
        out = [self.message(ids) for _ in range(n)]
        if self.chance(0.15):  # a conversation-shaped call and result, maybe a big one
            out += [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": r.choice(["bash", "read_file"]),
                                      "arguments": r.choice(['{"path": "docs/a.md"}', "{}"])}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": self.content(tool=True)}]
        return out

    def body(self) -> bytes:
        r = self.r
        if self.chance(0.05):
            return self.garbage()
        body: dict[str, Any] = {}
        if not self.chance(0.04):
            body["model"] = (r.choice(["gpt-4o", "gpt-4o", "tiny", "gpt-3.5-turbo", "o1"])
                             if self.chance(0.9) else self.scalar())
        if not self.chance(0.04):
            body["messages"] = self.messages()
        optional: dict[str, Callable[[], Any]] = {
            "stream_options": lambda: r.choice([{"include_usage": True}, {"include_usage": "x"},
                                                None, [], "x"]),
            "max_tokens": lambda: r.choice([16, 0, -1, 10**12, "100", None, 1.5, _NUM]),
            "max_completion_tokens": lambda: r.choice([16, -3, "x", None]),
            "tools": lambda: r.choice([[{"type": "function", "function": {"name": "bash",
                                                                         "parameters": {}}}],
                                       [{"type": "function", "function": {"name": READ_TOOL}}],
                                       [5], "x", None, [{"function": None}], self.value()]),
            "tool_choice": lambda: r.choice(["auto", "none", "required", {"type": "function"}, 5]),
            "metadata": lambda: r.choice([{"session_id": self.text(30)}, {"session_id": 5},
                                          {"session_id": ""}, "x", None, self.value()]),
            "user": lambda: r.choice([self.text(30), 5, None, "../../etc", ""]),
            "prompt_cache_key": lambda: r.choice([self.text(30), [], None, "a" * 300]),
            "n": lambda: r.choice([1, 2, 0, -1, "x"]),
            "temperature": lambda: r.choice([0, 2.5, "hot", None]),
            "response_format": lambda: r.choice([{"type": "json_object"}, "x", None]),
            "parallel_tool_calls": lambda: r.choice([True, "yes", None]),
            "extra": lambda: self.value(),
        }
        if self.chance(0.3):
            body["stream"] = r.choice([True, True, True, True, False, None, "true", 1, {}])
        for name, make in optional.items():
            if self.chance(0.15):
                body[name] = make()
        if self.chance(0.08):
            body["junk"] = _DEEP
        raw = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        return self.mutate(raw)

    def mutate(self, raw: bytes) -> bytes:
        r = self.r
        raw = raw.replace(b'"' + _DEEP.encode() + b'"', self.deep())
        while b'"' + _NUM.encode() + b'"' in raw:
            raw = raw.replace(b'"' + _NUM.encode() + b'"', r.choice(_NUMBERS), 1)
        while _SURR.encode() in raw:
            raw = raw.replace(_SURR.encode(), r.choice(_ESCAPES), 1)
        while _BYTES.encode() in raw:
            raw = raw.replace(_BYTES.encode(), r.choice(_INVALID_UTF8), 1)
        if self.chance(0.02) and raw:
            cut = r.randint(0, len(raw) - 1)
            raw = raw[:cut]
        if self.chance(0.01):
            raw = b"\xef\xbb\xbf" + raw
        if self.chance(0.01):
            raw = raw + r.choice([b"garbage", b",", b"}", b"\x00"])
        return raw

    def garbage(self) -> bytes:
        r = self.r
        return r.choice([
            b"", b"null", b"[]", b"1", b'"model"', b"{", b"}", b"{}", os.urandom(r.randint(1, 200)),
            b'{"model": NaN, "messages": []}', b'{"model": "m", "messages": [], "t": Infinity}',
            b'{"model": "m", "messages": [1e400]}', b'{"model": "m", "messages": [] ,}',
            b'{"model": "m", "model": 5, "messages": []}', b'{"model": "m", "messages": [],}',
            b'{"model": "m", "messages": [{"role": "user", "content": "a\\qb"}]}',
            b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 100_000 + b"\x00\"}]}",
            b'{"model": "m", "messages": [' + b'{"role":"user","content":"x"},' * 2000 + b"]}",
            b'{"model": 123456789012345678901234567890, "messages": []}',
            b"\xef\xbb\xbf{}", b'{"\xff": 1}', b'{"model": "m\xed\xa0\x80", "messages": []}',
            self.deep(), b'{"model": "m", "messages": ' + self.deep() + b"}",
        ])

    def headers(self) -> dict[bytes, bytes]:
        r = self.r
        out: dict[str, str] = {}
        out["content-type"] = r.choice(["application/json", "application/json", "text/plain",
                                        "application/x-www-form-urlencoded", ""])
        if self.chance(0.5):
            out["authorization"] = r.choice(["Bearer sk-fuzz-1", "Bearer sk-fuzz-2", "Bearer",
                                             "Basic !!!", "sk-raw", "Bearer " + "k" * 2000])
        if self.chance(0.3):
            out["x-session-id"] = r.choice(["fuzz-1", "fuzz-2", "../../etc", "a" * 500, ".", "..",
                                            "é", "x\ty", "-lead", "s/../../t"])
        if self.chance(0.05):
            out["x-claude-code-session-id"] = r.choice(["c1", "_bad", "%2e%2e"])
        return {k.encode(): v.encode() for k, v in out.items()}


class Crashes(logging.Handler):
    """Tracebacks and errors the proxy or its server logged: each one is a crash."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        where = ""
        if record.exc_info and record.exc_info[1] is not None:
            tb = record.exc_info[1].__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            if tb is not None:
                frame = tb.tb_frame.f_code
                where = f" [{record.exc_info[1]!r} at {frame.co_filename}:{tb.tb_lineno}]"
        self.records.append(f"{record.name}: {record.getMessage()[:300]}{where}")


def hostile_responder(body: dict[str, Any]) -> Reply:
    """The model: plain answers, except that an offered read tool is sometimes called with
    hostile arguments (once per request: the next round answers plainly)."""
    tools = body.get("tools")
    offered = isinstance(tools, list) and any(
        isinstance(t, dict) and isinstance(t.get("function"), dict)
        and t["function"].get("name") == READ_TOOL for t in tools)
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not offered or (isinstance(last, dict) and last.get("role") == "tool"):
        return Reply(content="ok")
    r = random.Random(len(orjson.dumps(body.get("messages"))))
    if r.random() < 0.3:
        return Reply(content="ok")
    args: Any = {"file_path": r.choice(_HOSTILE_PATHS)}
    if r.random() < 0.5:
        args["start_line"] = r.choice([1, 0, -1, 10**18, "1", None, 2.5, True])
    if r.random() < 0.3:
        args["start_byte"] = r.choice([0, -1, 10**18, "x", None])
    if r.random() < 0.1:
        args = r.choice(["{not json", "[]", "null", '"x"'])
    return Reply(content=None, tool_calls=[{"id": "r1", "name": READ_TOOL, "arguments": args}])


# --- realistic bodies, mutated -----------------------------------------------------------------

#: The recorded requests of the real CLIs (:mod:`harness.recorded_calls`).
FIXTURES: Final = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "provenance"
#: Each format's route, and the model that makes a seed compact (the fuzz configs give it a
#: 3,000-token window).
FORMATS: Final = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
                  "messages": "/v1/messages"}
TINY: Final = "tiny"
_BIG_OUTPUT: Final = "".join(f"{i:05d} " + "log line of a long build output\n" for i in range(1800))

_CLAUDE_SYSTEM: Final = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "You are an interactive CLI tool that helps users with software "
     "engineering tasks.\n\n<env>\nWorking directory: /tmp/ctxproxy-recording/claude\n"
     "Platform: linux\n</env>", "cache_control": {"type": "ephemeral"}},
]
_CODEX_INSTRUCTIONS: Final = ("You are Codex, based on GPT-5. You are running as a coding agent "
                              "in the Codex CLI on a user's computer.")
_CODEX_PREAMBLE: Final = [
    {"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write"
                                       "</permissions instructions>"}]},
    {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "<environment_context>\n  <cwd>/tmp/ctxproxy-recording/"
                                       "codex</cwd>\n  <shell>bash</shell>\n"
                                       "</environment_context>"}]},
]
_APPLY_PATCH_GRAMMAR: Final = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'


def _schema(params: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": {p: {"type": "string"} for p in params},
            "required": list(params[:1]), "additionalProperties": False}


def _claude_code(fixture: Mapping[str, Any]) -> dict[str, Any]:
    """Claude Code's request: the recorded conversation, its system blocks and tool schemas."""
    body = copy.deepcopy(dict(fixture["body"]))
    tools = [{"name": name, "description": f"The {name} tool.", "input_schema": _schema(params)}
             for name, params in fixture["tools"].items()]
    return {"model": body["model"], "max_tokens": body.get("max_tokens", 32000),
            "system": copy.deepcopy(_CLAUDE_SYSTEM), "messages": body["messages"],
            "tools": tools, "metadata": {"user_id": "user_fuzz_account__session_"
                                         "0b7e2c36-5f0e-4a53-9d1a-8f3b2c1d0e9f"},
            "thinking": {"type": "enabled", "budget_tokens": 4096}, "stream": True}


def _codex(fixture: Mapping[str, Any]) -> dict[str, Any]:
    """Codex's request: the recorded items after its developer and environment messages, its
    instructions and tool schemas (a function tool, the free-form apply_patch)."""
    body = copy.deepcopy(dict(fixture["body"]))
    tools: list[dict[str, Any]] = []
    for name, params in fixture["tools"].items():
        if params:
            tools.append({"type": "function", "name": name, "description": f"Runs {name}.",
                          "strict": False, "parameters": _schema(params)})
        else:
            tools.append({"type": "custom", "name": name, "description": "Edits files.",
                          "format": {"type": "grammar", "syntax": "lark",
                                     "definition": _APPLY_PATCH_GRAMMAR}})
    return {"model": body["model"], "instructions": _CODEX_INSTRUCTIONS,
            "input": [*copy.deepcopy(_CODEX_PREAMBLE), *body["input"]], "tools": tools,
            "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199a2b3-c4d5-7e6f-8a9b-0c1d2e3f4a5b"}


def _chat(codex: Mapping[str, Any]) -> dict[str, Any]:
    """The Codex conversation as a chat-completions client sends it (function and custom tool
    calls, their results)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": codex["instructions"]}]
    for item in codex["input"]:
        kind = item.get("type")
        if kind == "message":
            messages.append({"role": item["role"], "content": [
                {"type": "text", "text": p["text"]} for p in item["content"]]})
        elif kind in ("function_call", "custom_tool_call"):
            call: dict[str, Any] = (
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}}
                if kind == "function_call" else
                {"id": item["call_id"], "type": "custom",
                 "custom": {"name": item["name"], "input": item["input"]}})
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                  "parameters")}}
             if t["type"] == "function" else
             {"type": "custom", "custom": {"name": t["name"], "description": t["description"],
                                           "format": t["format"]}}
             for t in codex["tools"]]
    return {"model": "gpt-4o", "messages": messages, "tools": tools, "tool_choice": "auto",
            "stream": True, "stream_options": {"include_usage": True},
            "prompt_cache_key": codex["prompt_cache_key"]}


def _results(fmt: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool-result objects of a body whose output text is a string (where a big one goes)."""
    if fmt == "chat":
        return [m for m in body["messages"] if m.get("role") == "tool"]
    if fmt == "responses":
        return [i for i in body["input"] if str(i.get("type", "")).endswith("_output")]
    return [b for m in body["messages"] if isinstance(m.get("content"), list)
            for b in m["content"] if b.get("type") == "tool_result"
            and isinstance(b.get("content"), str)]


def _variants(fmt: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body as recorded, without streaming and with a big tool output (offload), cut
    short after its first call, and as the compacting model."""
    key = {"chat": "content", "responses": "output", "messages": "content"}[fmt]
    items = "input" if fmt == "responses" else "messages"
    big = copy.deepcopy(body)
    big["stream"] = False
    for result in _results(fmt, big)[:1]:
        result[key] = _BIG_OUTPUT
    short = copy.deepcopy(body)
    short[items] = short[items][: {"chat": 4, "responses": 5, "messages": 3}[fmt]]
    tiny = copy.deepcopy(big)
    tiny["model"] = TINY
    return [body, big, short, tiny]


def seeds(fmt: str, fixtures: Path = FIXTURES) -> list[dict[str, Any]]:
    """Realistic request bodies of ``fmt`` ("chat", "responses", "messages") to mutate."""
    codex = _codex(json.loads((fixtures / "codex.json").read_text()))
    if fmt == "responses":
        return _variants(fmt, codex)
    if fmt == "chat":
        return _variants(fmt, _chat(codex))
    if fmt == "messages":
        return _variants(fmt, _claude_code(json.loads((fixtures / "claude_code.json").read_text())))
    raise ValueError(f"unknown format {fmt!r}")


# What the mutations put where a word was.
_ROLE_WORDS: Final = ["user", "assistant", "system", "developer", "tool", "function", "model", ""]
_TYPE_WORDS: Final = [
    "text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document",
    "server_tool_use", "web_search_tool_result", "compaction", "tool_reference", "message",
    "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
    "reasoning", "input_text", "output_text", "input_image", "refusal", "additional_tools",
    "compaction_trigger", "local_shell_call", "program", "program_output", "item_reference",
    "image_url", "file", "custom", "function", "new_kind_2027", "",
]
_ID_KEYS: Final = frozenset({"id", "call_id", "tool_use_id", "tool_call_id"})
# Keys the proxy reads: mutated three times as often as others.
_READ_KEYS: Final = frozenset({
    *_ID_KEYS, "type", "role", "content", "text", "output", "input", "arguments", "name",
    "tool_calls", "function", "custom", "tools", "messages", "system", "instructions",
    "thinking", "signature", "summary", "encrypted_content", "cache_control", "metadata",
    "model", "stream", "previous_response_id", "image_url", "source", "is_error",
})
_Node = tuple[dict[str, Any] | list[Any], str | int, Any]


def _nodes(value: Any) -> Iterator[_Node]:
    """Every (container, key, value) below ``value``."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield value, key, inner
            yield from _nodes(inner)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield value, i, inner
            yield from _nodes(inner)


class Mutator:
    """Mutated realistic bodies of one format, from a seeded generator (see the module
    docstring). ``Mutator(seed, seeds("messages")).body()`` is one case's bytes."""

    def __init__(self, seed: int, bodies: Sequence[Mapping[str, Any]]) -> None:
        self.gen = Gen(seed)
        self.r = self.gen.r
        self.bodies = bodies

    def body(self) -> bytes:
        r = self.r
        body = copy.deepcopy(dict(r.choice(self.bodies)))
        for _ in range(1 + (r.random() < 0.35) + (r.random() < 0.15)):
            self.mutate(body)
        raw = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        # Gen's placeholders become what orjson never writes (lone surrogates, invalid UTF-8,
        # numbers out of range); a tenth of the cases get its byte-level damage too.
        damage = self.gen.chance(0.1)
        return self.gen.mutate(raw) if damage or b"@@" in raw else raw

    def mutate(self, body: dict[str, Any]) -> None:
        """One mutation of ``body``, in place."""
        r = self.r
        nodes = list(_nodes(body))
        weights = [3 if key in _READ_KEYS or isinstance(key, int) else 1 for _, key, _ in nodes]
        container, key, value = r.choices(nodes, weights)[0]
        ops: list[Callable[[], Any]] = [lambda: self.hostile(value)]
        if isinstance(key, str) and key in _ID_KEYS:
            ids = [v for _, k, v in nodes if k in _ID_KEYS and isinstance(v, str)]
            ops += [lambda: r.choice(ids) if ids else "x", lambda: f"call_{r.randint(0, 99)}"] * 2
        if key == "role":
            ops += [lambda: r.choice(_ROLE_WORDS)] * 2
        if key == "type":
            ops += [lambda: r.choice(_TYPE_WORDS)] * 2
        if isinstance(value, str) and key in ("content", "output", "text"):
            ops.append(lambda: _BIG_OUTPUT * r.choice([1, 2]))
        others = [v for _, _, v in nodes if v is not value]
        if others:
            ops.append(lambda: copy.deepcopy(r.choice(others)))  # a value from elsewhere
        pick = r.random()
        if pick < 0.15:  # drop it
            del container[key]  # type: ignore[arg-type]
        elif pick < 0.25 and isinstance(container, list) and isinstance(key, int):
            # duplicate it or move it
            moved = copy.deepcopy(value) if self.gen.chance(0.5) else container.pop(key)
            container.insert(r.randint(0, len(container)), moved)
        elif pick < 0.32 and isinstance(value, dict):  # a field no one knows yet
            value[self.gen.text(8) or "x_new"] = self.gen.value()
        else:
            container[key] = r.choice(ops)()  # type: ignore[index]

    def hostile(self, value: Any) -> Any:
        """A value of another shape than ``value``."""
        r = self.r
        makers: list[Callable[[], Any]] = [
            lambda: self.gen.scalar(), lambda: self.gen.value(), lambda: [value],
            lambda: {"type": value}, lambda: {self.gen.text(6): value},
            lambda: orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode(),
            lambda: None, lambda: {}, lambda: [], lambda: r.choice([0, -1, 1.5, True, _NUM]),
            lambda: self.gen.text(),
        ]
        return r.choice(makers)()


# --- judging answers ---------------------------------------------------------------------------

ENVELOPE_KEYS: Final = frozenset({"message", "type", "param", "code"})
# How each format's stream ends (or the error event it ends with).
_STREAM_ENDS: Final = {"chat": (b"data: [DONE]\n\n",), "responses": (b"response.completed",
                       b"response.failed", b"response.incomplete"),
                       "messages": (b"message_stop",)}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What is wrong with one answer (nothing: every field false)."""

    proxy_5xx: bool = False
    envelope: bool = False  # an error outside its route's envelope
    unterminated: bool = False  # a stream that did not end

    def __bool__(self) -> bool:
        return self.proxy_5xx or self.envelope or self.unterminated


def envelope_ok(fmt: str, status: int, content_type: str, content: bytes) -> bool:
    """Whether an error answer is in the route's envelope: OpenAI's
    ``{"error": {message, type, param, code}}``, or Anthropic's ``{"type": "error", "error":
    {type, message}}`` for ``/v1/messages``."""
    if not content_type.startswith("application/json"):
        return False
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return False
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not err["message"]:
        return False
    if fmt == "messages":
        return data.get("type") == "error" and isinstance(err.get("type"), str)
    return set(err) == ENVELOPE_KEYS and isinstance(err["type"], str)


def judge(fmt: str, status: int, content_type: str, content: bytes, stream: bool) -> Verdict:
    """The answer of a format's route judged (the fake upstream never answers a 5xx: one is
    the proxy's)."""
    if status >= 400:
        return Verdict(proxy_5xx=status >= 500,
                       envelope=not envelope_ok(fmt, status, content_type, content))
    if stream and content_type.startswith("text/event-stream"):
        last = content.rstrip(b"\n").rsplit(b"\n\n", 1)[-1] + b"\n\n"  # the last event
        ended = any(end in last for end in _STREAM_ENDS[fmt]) or b'"error"' in last[:300]
        return Verdict(unterminated=not ended)
    return Verdict()


# --- the model ---------------------------------------------------------------------------------


def _offered(tools: Any) -> bool:
    """Whether the request offers the read tool, in any format's tool shape."""
    if not isinstance(tools, list):
        return False
    for t in tools:
        if isinstance(t, dict):
            fn = t.get("function")
            name = fn.get("name") if isinstance(fn, dict) else t.get("name")
            if name == READ_TOOL:
                return True
    return False


def _answered(body: Mapping[str, Any]) -> bool:
    """Whether the request's last item is a tool result (the read round's answer)."""
    items = body.get("messages", body.get("input"))
    last = items[-1] if isinstance(items, list) and items else None
    if not isinstance(last, dict):
        return False
    if last.get("role") == "tool" or str(last.get("type", "")).endswith("_output"):
        return True
    content = last.get("content")
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


_SUMMARY: Final = "\n".join(f"{heading}\n- the fuzzed session goes on" for heading in SECTIONS)


def _summarizing(body: Mapping[str, Any]) -> bool:
    """Whether the request is the compactor's summarizer call (its prompt is the system
    message, or Anthropic's ``system``)."""
    system = body.get("system")
    messages = body.get("messages")
    if not isinstance(system, str) and isinstance(messages, list) and messages:
        system = messages[0].get("content") if isinstance(messages[0], dict) else None
    return isinstance(system, str) and system.startswith(SYSTEM_PROMPT[:60])


def responder(body: dict[str, Any]) -> Reply:
    """:func:`hostile_responder` for every format: an offered read tool is sometimes called
    with hostile arguments, once per request; the summarizer gets a valid summary (one call
    per compaction, not a retry and the deterministic fallback)."""
    if _summarizing(body):
        return Reply(content=_SUMMARY)
    if not _offered(body.get("tools")) or _answered(body):
        return Reply(content="ok")
    r = random.Random(len(orjson.dumps(body.get("messages", body.get("input")))))
    if r.random() < 0.3:
        return Reply(content="ok")
    args: Any = {"file_path": r.choice(_HOSTILE_PATHS)}
    if r.random() < 0.5:
        args["start_line"] = r.choice([1, 0, -1, 10**18, "1", None, 2.5, True])
    if r.random() < 0.1:
        args = r.choice(["{not json", "[]", "null", '"x"'])
    return Reply(content=None, tool_calls=[{"id": "r1", "name": READ_TOOL, "arguments": args}])


@dataclass(frozen=True, slots=True)
class Case:
    """One generated request of a format."""

    index: int
    raw: bytes

    @property
    def stream(self) -> bool:
        return b'"stream":true' in self.raw


def cases(fmt: str, count: int, seed: int, start: int = 0) -> Iterator[Case]:
    """Cases ``start`` .. ``start + count - 1`` of ``seed``: mutated :func:`seeds` of ``fmt``
    (case ``i`` is the same bytes on every run and whatever the count)."""
    bodies = seeds(fmt)
    for i in range(start, start + count):
        yield Case(i, Mutator(seed * 1_000_003 + i, bodies).body())
