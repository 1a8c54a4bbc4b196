"""Per-tool policies: matching calls and their results (proxy.offload.policies)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.config import Config, config_from_mapping
from proxy.config.offload import ToolPolicy
from proxy.errors import ConfigError
from proxy.offload.policies import Policies, shell_command


def call(name: str, args: Any, cid: str = "c1") -> dict[str, Any]:
    raw = args if isinstance(args, str) else orjson.dumps(args).decode()
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": raw}}]}


def result(cid: str = "c1", text: str = "out") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": text}


@pytest.mark.parametrize(("args", "command"), [
    ({"command": "grep -rn foo src"}, "grep -rn foo src"),
    ({"cmd": "cd /repo && rg -n bar"}, "rg -n bar"),
    ({"command": ["bash", "-lc", "cd '/a b' && git diff HEAD"]}, "git diff HEAD"),
    ({"command": ["ls", "-la"]}, "ls -la"),
    ({"action": {"type": "exec", "command": ["bash", "-lc", "head -n 5 x"]}}, "head -n 5 x"),
    ({"path": "x"}, None),
])
def test_shell_commands(args: dict[str, Any], command: str | None) -> None:
    assert shell_command(orjson.dumps(args).decode()) == command


def test_first_match_wins_by_name_glob_and_command() -> None:
    grep = ToolPolicy(tool="Bash", command="grep*", protect=True)
    mcp = ToolPolicy(tool="mcp__*", offload_max_bytes=20000, dedupe=False)
    shells = ToolPolicy(tool="exec_command", command="rg *", dedupe=False)
    anybash = ToolPolicy(tool="Bash", old_max_bytes=1000)
    p = Policies([grep, mcp, shells, anybash])
    assert p.of_call("Bash", '{"command": "grep -rn x ."}') is grep
    assert p.of_call("Bash", '{"command": "cd src && grep x y"}') is grep
    assert p.of_call("Bash", '{"command": "pytest -q"}') is anybash
    assert p.of_call("mcp__github__search", "{}") is mcp
    assert p.of_call("exec_command", '{"cmd": "rg -n foo"}') is shells
    assert p.of_call("exec_command", '{"cmd": "cat foo"}') is None
    assert p.of_call("Read", '{"file_path": "/x"}') is None
    # A command glob never matches a tool that is not a shell, whatever its arguments say.
    assert Policies([ToolPolicy(tool="*", command="grep*")]).of_call(
        "Grep", '{"command": "grep x"}') is None


def test_results_get_their_calls_policy() -> None:
    p = Policies(Config().offload.policies)
    history = [{"role": "user", "content": "go"},
               call("Read", {"file_path": "/a.py"}, "r1"), result("r1"),
               call("Edit", {"file_path": "/a.py", "old_string": "x", "new_string": "y"}, "e1"),
               result("e1"), result("orphan")]
    found = p.of_results(history)
    # The defaults keep edit tools' results at their stage-1 form, never deltas or references.
    assert list(found) == [4] and found[4].old_max_bytes == 51200 and not found[4].dedupe
    assert not found[4].protect  # a huge one is still cut on arrival
    assert Policies([]).of_results(history) == {}


def test_policies_in_the_config() -> None:
    config = config_from_mapping({"offload": {"policies": [
        {"tool": "Bash", "command": "grep*", "protect": True}]}})
    assert config.offload.policies == (ToolPolicy(tool="Bash", command="grep*", protect=True),)
    with pytest.raises(ConfigError, match="offload_max_bytes"):
        config_from_mapping({"offload": {"policies": [{"tool": "x", "offload_max_bytes": 1}]}})
    with pytest.raises(ConfigError, match="tool"):
        config_from_mapping({"offload": {"policies": [{"protect": True}]}})


@given(st.text(max_size=40), st.text(max_size=80))
def test_matching_is_deterministic_and_cached(name: str, arguments: str) -> None:
    p = Policies([ToolPolicy(tool="B*", command="g*"), ToolPolicy(tool="*", dedupe=False)])
    first = p.of_call(name, arguments)
    assert p.of_call(name, arguments) is first
    assert first is not None  # the catch-all matches everything


# --- what the offload stage does with them ---------------------------------------------------

def _offloader(tmp_path: Any, policies: list[dict[str, Any]]) -> Any:
    from proxy.config.offload import OffloadConfig
    from proxy.config.retrieval import RetrievalConfig
    from proxy.offload.stage import Offloader

    config = OffloadConfig(policies=tuple(ToolPolicy(**p) for p in policies), recent_n=1)
    return Offloader(config, RetrievalConfig(), tmp_path)


def _session(commands: list[str], size: int) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i, command in enumerate(commands):
        history.append(call("Bash", {"command": command}, f"c{i}"))
        history.append(result(f"c{i}", "".join(f"{command} line {k}\n" for k in range(size))))
    return history


def _view(history: list[dict[str, Any]]) -> Any:
    from proxy.model import RequestView
    from proxy.session import Identity

    return RequestView(model="gpt-4o", body={"messages": history},
                       identity=Identity("t", "s", None))


def test_a_protected_result_is_never_cut_and_budgets_apply(tmp_path: Any) -> None:
    history = _session(["grep -rn x src", "pytest -q", "cat big.log"], 4000)  # ~90 KB each
    off = _offloader(tmp_path, [
        {"tool": "Bash", "command": "grep*", "protect": True},
        {"tool": "Bash", "command": "pytest*", "offload_max_bytes": 10000},
    ])
    out = off.run(history, _view(history), aged_turns=0).messages
    assert out[2] is history[2]  # grep: whole, however large
    assert 10000 <= len(out[4]["content"].encode()) < 11000  # its own stage-1 budget
    assert 51200 <= len(out[6]["content"].encode()) < 52000  # the default
    aged = off.run(history, _view(history), aged_turns=2).messages
    assert aged[2] is history[2]  # not aged either
    assert len(aged[4]["content"].encode()) < 4000
    # The last resort's first pass spares protected results; its 1 KB pass does not.
    spare = off.protected(history, _view(history), aged_turns=2)
    assert spare == frozenset({"c0"})
    from proxy.session import Identity
    first = off.harder(out, Identity("t", "s", None), 3000, spare).messages
    assert first[2] is history[2]
    last = off.harder(out, Identity("t", "s", None), 1024, frozenset()).messages
    assert len(last[2]["content"].encode()) < 2000


def test_an_old_budget_override(tmp_path: Any) -> None:
    history = _session(["cat a", "cat b"], 4000)
    off = _offloader(tmp_path, [{"tool": "Bash", "command": "cat a", "old_max_bytes": 8000}])
    aged = off.run(history, _view(history), aged_turns=1).messages
    assert 8000 <= len(aged[2]["content"].encode()) < 9000
