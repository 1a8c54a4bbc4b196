from __future__ import annotations

from proxy.session import ANON, derived_session, resolve, safe_name, tenant_of


def test_tenant_is_a_hash_never_the_key() -> None:
    key = "sk-secret-abcdef"
    t = tenant_of(key)
    assert key not in t and t == tenant_of(key) and t != tenant_of(key + "x")
    assert tenant_of(None) == ANON


def test_session_precedence() -> None:
    body = {"metadata": {"session_id": "meta"}, "prompt_cache_key": "pck", "user": "u", "messages": []}
    h = {"authorization": "Bearer k"}
    assert resolve({**h, "x-ctxproxy-session": "a", "x-session-id": "b"}, body).session == "a"
    assert resolve({**h, "x-session-id": "b"}, body).session == "b"
    assert resolve({**h, "x-claude-code-session-id": "c"}, body).session == "c"
    assert resolve(h, body).session == "meta"
    assert resolve(h, {**body, "metadata": {}}).session == "pck"
    assert resolve(h, {"user": "u", "messages": []}).session == "u"


def test_derived_session_is_stable_across_turns() -> None:
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert derived_session("t", first) == derived_session("t", later)
    assert derived_session("t", first) != derived_session("t2", first)
    other = [{"role": "system", "content": "sys"}, {"role": "user", "content": "different"}]
    assert derived_session("t", first) != derived_session("t", other)


def test_unsafe_session_names_are_hashed() -> None:
    for raw in ["../etc", "a/b", "", ".hidden", "x" * 200, "a\x00b", "ü"]:
        name = safe_name(raw)
        assert "/" not in name and ".." not in name and not name.startswith(".")
        assert name.startswith("h-")
    assert safe_name("abc-123_x.y") == "abc-123_x.y"


def test_key_from_other_headers() -> None:
    assert resolve({"x-api-key": "k1"}, {"messages": []}).tenant == tenant_of("k1")
    assert resolve({"api-key": "k2"}, {"messages": []}).tenant == tenant_of("k2")
    assert resolve({}, {"messages": []}).tenant == ANON
