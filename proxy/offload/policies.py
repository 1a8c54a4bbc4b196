"""Per-tool policies (``offload.policies``): which tool results are never cut, which get other
budgets, which are never forwarded as a delta or a reference (pure).

A policy names a tool (its name, or a glob: ``mcp__*``) and, for shell tools, optionally a glob
the call's command must match (``grep*``, ``git diff*``): the command as the model wrote it, with
a ``cd DIR &&`` prefix and a ``bash -lc`` wrapper left out. The first policy that matches a
result's call applies; none matching means the defaults. Shell tools are Codex's
``exec_command`` / ``shell`` / ``local_shell_call`` / ``shell_call`` / ``container.exec``
and Claude Code's ``Bash``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Final

from proxy.config.offload import ToolPolicy
from proxy.filewise.provenance import json_args
from proxy.filewise.shell import shell_script
from proxy.history.turns import RESULT_ROLES
from proxy.lru import LRU
from proxy.model import Message

__all__ = ["SHELL_TOOLS", "Policies", "shell_command"]

SHELL_TOOLS: Final = frozenset({"exec_command", "shell", "local_shell_call", "shell_call",
                                "container.exec", "Bash"})
_CD: Final = re.compile(r"^\s*cd\s+(?:\"[^\"]*\"|'[^']*'|\S+)\s*&&\s*")


def shell_command(arguments: str) -> str | None:
    """The command a shell call runs, as the model wrote it, a leading ``cd DIR &&`` left out
    (None: not a shell call's arguments)."""
    args = json_args(arguments)
    script, _ = shell_script(args) if args else (None, None)
    return _CD.sub("", script).strip() if script is not None else None


# What an entry of a cache keyed by a call costs besides its strings (the tuple, the dict slot).
_ENTRY = 200


class Policies:
    """The configured policies, matched against calls (results are matched through the call
    they answer). Matching is cached per call (name and arguments): a resent history costs a
    dictionary probe per result."""

    def __init__(self, policies: Sequence[ToolPolicy], *,
                 cache_bytes: int = 16 * 1024 * 1024) -> None:
        self.policies = tuple(policies)
        # Sized by the call each entry pins (a Write's arguments hold a whole file).
        self._calls: LRU[tuple[str, str], ToolPolicy | None] = LRU(
            cache_bytes, lambda key, _: len(key[0]) + len(key[1]) + _ENTRY)

    def of_call(self, name: str, arguments: str) -> ToolPolicy | None:
        """The first policy matching a call of ``name`` with ``arguments``."""
        if not self.policies:
            return None
        key = (name, arguments)
        if key in self._calls:
            return self._calls.get(key)
        found = None
        command: str | None = None
        for policy in self.policies:
            if not fnmatch.fnmatchcase(name, policy.tool):
                continue
            if policy.command is not None:
                if name not in SHELL_TOOLS:
                    continue
                if command is None:
                    command = shell_command(arguments) or ""
                if not fnmatch.fnmatchcase(command, policy.command):
                    continue
            found = policy
            break
        self._calls.put(key, found)
        return found

    def of_results(self, messages: Sequence[Message]) -> dict[int, ToolPolicy]:
        """History index of each tool result whose call a policy matches -> that policy."""
        if not self.policies:
            return {}
        calls: dict[str, ToolPolicy | None] = {}
        out: dict[int, ToolPolicy] = {}
        for i, m in enumerate(messages):
            role = m.get("role")
            if role == "assistant":
                for call in m.get("tool_calls") or ():
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict) and isinstance(call.get("id"), str) and isinstance(
                            fn.get("name"), str):
                        args = fn.get("arguments")
                        calls[call["id"]] = self.of_call(fn["name"],
                                                         args if isinstance(args, str) else "")
            elif role in RESULT_ROLES:
                cid = m.get("tool_call_id")
                policy = calls.get(cid) if isinstance(cid, str) else None
                if policy is not None:
                    out[i] = policy
        return out
