"""`read_offloaded`: the tool the proxy adds and runs itself, confined to one session's files."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from proxy.compaction.message import is_summary_message
from proxy.config import Config
from proxy.errors import OffloadedFileMissing
from proxy.memory.inject import is_memory_message
from proxy.session import Identity
from proxy.store import fs
from proxy.store.backend import DiskFiles
from proxy.store.interfaces import MemoryStore, Originals, SessionFiles
from proxy.store.paths import DIALOG_DIR, MEMORY_DAYS_DIR, TOOL_RESULT_DIR
from proxy.truncation.cut import read_chunk
from proxy.truncation.notice import parse_notice

_ALLOWED = re.compile(
    rf"(?:{TOOL_RESULT_DIR}/[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}\.txt"
    rf"|{DIALOG_DIR}/\d{{4}}-\d{{2}}-\d{{2}}\.jsonl"
    rf"|{MEMORY_DAYS_DIR}/\d{{4}}-\d{{2}}-\d{{2}}\.md)"
)


class ReadTool:
    def __init__(
        self, config: Config, store: Originals, files: SessionFiles | None = None,
        memory: MemoryStore | None = None,
    ) -> None:
        self.name = config.retrieval.tool_name
        self.budget = config.offload.recent_max_bytes
        self.store = store
        self.memory = memory  # the memory scope's daily notes, memory/YYYY-MM-DD.md
        # Where the archive is read from (a directory, or the shared database's rows).
        self.files = files if files is not None else DiskFiles(Path(config.storage.data_dir))

    def definition(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": (
                    "Read content the context manager saved to a file: a tool output that was "
                    "truncated (see the <<<TRUNCATED>>> notice) or the archived dialog named by a "
                    "conversation summary. Returns up to "
                    f"{self.budget} bytes starting at start_line (and start_byte within that "
                    "line); when more remains, the result ends with a notice giving the next "
                    "start_line to continue from."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "file_path": {
                            "type": "string",
                            "description": "The file_path given in the notice or the summary, "
                            "e.g. tool_result/<id>.txt or dialog/YYYY-MM-DD.jsonl.",
                        },
                        "start_line": {
                            "type": "integer", "minimum": 1,
                            "description": "First line to read (1-based).",
                        },
                        "start_byte": {
                            "type": "integer", "minimum": 0,
                            "description": "Byte offset within start_line, when a notice gives one.",
                        },
                    },
                    "required": ["file_path"],
                },
            },
        }

    def needed(self, messages: Sequence[Any]) -> bool:
        """Whether the forwarded messages point at the proxy's files (a notice or a summary)
        or hold the proxy's own calls (its read rounds put back: the tool they call must stay
        defined, or the provider refuses the history and its cache misses)."""
        for m in messages:
            if not isinstance(m, dict):
                continue
            if m.get("role") == "assistant":
                for call in m.get("tool_calls") or ():
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict) and fn.get("name") == self.name:
                        return True
            elif m.get("role") in ("tool", "function"):
                content = m.get("content")
                text = content if isinstance(content, str) else _first_text(content)
                notice = parse_notice(text) if text else None
                if notice is not None and notice.tool == self.name:
                    return True
            elif is_summary_message(m) or is_memory_message(m):
                return True
        return False

    def with_tool(self, body: dict[str, Any]) -> dict[str, Any]:
        tools = body.get("tools")
        tools = list(tools) if isinstance(tools, list) else []
        if any(isinstance(t, dict) and (t.get("function") or {}).get("name") == self.name for t in tools):
            return body
        return {**body, "tools": [*tools, self.definition()]}

    def run(self, identity: Identity, arguments: str) -> str:
        """The tool's result text; errors are results too (the model reads them), never a raise."""
        if not isinstance(arguments, str):  # a malformed upstream answer
            return "error: the arguments must be a string of JSON"
        try:
            args = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            return "error: the arguments are not valid JSON"
        if not isinstance(args, dict):
            return "error: the arguments must be a JSON object"
        path = args.get("file_path")
        line = args.get("start_line", 1)
        byte = args.get("start_byte", 0)
        if not isinstance(path, str) or not _ALLOWED.fullmatch(path):
            return (f"error: file_path must name this conversation's tool_result/<id>.txt or "
                    f"dialog/YYYY-MM-DD.jsonl file, or a memory/YYYY-MM-DD.md note, got "
                    f"{str(path)[:200]!r}")
        if not isinstance(line, int) or isinstance(line, bool) or line < 1:
            return "error: start_line must be an integer >= 1"
        if not isinstance(byte, int) or isinstance(byte, bool) or byte < 0:
            return "error: start_byte must be an integer >= 0"
        try:
            text = self._read(identity, path)
        except OffloadedFileMissing as exc:
            return f"error: {exc}"
        except (OSError, ValueError) as exc:
            return f"error: cannot read {path}: {type(exc).__name__}"
        try:
            return read_chunk(text, line, byte, self.budget, file_path=path, tool=self.name)
        except ValueError as exc:
            return f"error: {exc}"

    def _read(self, identity: Identity, path: str) -> str:
        if path.startswith(TOOL_RESULT_DIR + "/"):
            rid = path[len(TOOL_RESULT_DIR) + 1 : -len(".txt")]
            return self.store.read(identity.tenant, identity.session, rid)
        if path.startswith(MEMORY_DAYS_DIR + "/"):
            day = path[len(MEMORY_DAYS_DIR) + 1 : -len(".md")]
            found = self.memory.read_day(identity.tenant, identity.memory_scope, day) if (
                self.memory is not None) else None
            if found is None:
                raise OffloadedFileMissing(f"{path}: no memory notes of that day")
            return found
        try:
            fd, info = self.files.open(identity.tenant, identity.session, "dialog",
                                       path[len(DIALOG_DIR) + 1 :])
        except fs.Hidden:
            raise OffloadedFileMissing(f"{path} does not exist in this conversation") from None
        return b"".join(fs.iter_chunks(fd, info.st_size)).decode("utf-8", "replace")


def _first_text(content: Any) -> str | None:
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                return str(part["text"])
    return None
