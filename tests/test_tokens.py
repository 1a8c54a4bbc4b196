"""Tests for proxy.tokens.counter and proxy.catalog.data (docs/tokens.md#counting)."""

from __future__ import annotations

import base64
import importlib.util
import random
import socket
import struct
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry

from proxy.catalog import data as tokenizer_data
from proxy.tokens import counter as tk
from proxy.tokens import media
from proxy.tokens.counter import (
    CL100K,
    ESTIMATE,
    O200K,
    TokenCounter,
    encoding_name_for_model,
    image_dimensions_from_data_url,
    image_tokens,
)

Message = dict[str, Any]


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    tc = TokenCounter()
    tc.preload(("gpt-4o", "gpt-4"))
    assert tc.encoding_name("gpt-4o") == O200K
    assert tc.encoding_name("gpt-4") == CL100K
    return tc


# ------------------------------------------------------------------ reference implementation


def cookbook_num_tokens_from_messages(messages: list[Message], encoding_name: str) -> int:
    """``num_tokens_from_messages`` from the OpenAI cookbook ("How to count tokens with
    tiktoken"), for gpt-3.5-turbo/gpt-4/gpt-4o: 3 per message, +1 per name, +3 priming."""
    encoding = tiktoken.get_encoding(encoding_name)
    tokens_per_message = 3
    tokens_per_name = 1
    num_tokens = 0
    for message in messages:
        num_tokens += tokens_per_message
        for key, value in message.items():
            num_tokens += len(encoding.encode(value, disallowed_special=()))
            if key == "name":
                num_tokens += tokens_per_name
    num_tokens += 3
    return num_tokens


def cookbook_num_tokens_for_tools(functions: list[Message], encoding_name: str) -> int:
    """Tool part of the cookbook's ``num_tokens_for_tools`` (gpt-4o / gpt-4 constants)."""
    encoding = tiktoken.get_encoding(encoding_name)
    func_init = 7 if encoding_name == O200K else 10
    prop_init, prop_key, enum_init, enum_item, func_end = 3, 3, -3, 3, 12
    count = 0
    for f in functions:
        count += func_init
        function = f["function"]
        desc = function["description"]
        desc = desc.removesuffix(".")
        count += len(encoding.encode(function["name"] + ":" + desc))
        if len(function["parameters"]["properties"]) > 0:
            count += prop_init
            for key, prop in function["parameters"]["properties"].items():
                count += prop_key
                if "enum" in prop:
                    count += enum_init
                    for item in prop["enum"]:
                        count += enum_item
                        count += len(encoding.encode(item))
                p_desc = prop["description"]
                p_desc = p_desc.removesuffix(".")
                count += len(encoding.encode(f"{key}:{prop['type']}:{p_desc}"))
    return count + func_end


def random_conversation(seed: int, n: int) -> list[Message]:
    rng = random.Random(seed)
    snippets = [
        "Please refactor the function `parse_config` in src/app/config.py so it handles YAML.",
        "def add(a: int, b: int) -> int:\n    return a + b\n",
        "Error: ModuleNotFoundError: No module named 'foo.bar' (see /var/log/app.log:1234)",
        "Les élèves ont étudié la théorie de la relativité générale pendant trois heures.",
        "日本語のテキストも正しく数える必要があります。東京は日本の首都です。",
        "Здравствуйте! Как дела? Это тест на русском языке.",
        "🙂🚀 emojis and symbols: ∑∫√ ≠ ≤ ≥ — “quotes” and ‘apostrophes’",
        "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id DESC LIMIT 10;",
        '{"key": [1, 2, 3], "nested": {"a": true, "b": null}, "s": "value with spaces"}',
        "   leading and trailing whitespace\n\n\n\ttabs\tand\r\nnewlines   ",
        "<|endoftext|> special tokens in user text are plain text <|im_start|>",
    ]
    messages: list[Message] = [{"role": "system", "content": "You are a careful coding agent."}]
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        words = f"[turn {i}] " + " ".join(rng.choice(snippets) for _ in range(rng.randint(1, 6)))
        message: Message = {"role": role, "content": words}
        if rng.random() < 0.2:
            message["name"] = rng.choice(["alice", "bob_the_builder", "agent-7"])
        messages.append(message)
    return messages


# ------------------------------------------------------------------ model -> encoding


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", O200K),
        ("gpt-4o-mini-2024-07-18", O200K),
        ("openai/gpt-4.1", O200K),
        ("azure/gpt-4.1-mini", O200K),
        ("gpt-4.5-preview", O200K),
        ("gpt-5", O200K),
        ("o1-preview", O200K),
        ("o3-mini", O200K),
        ("o4-mini", O200K),
        ("chatgpt-4o-latest", O200K),
        ("ft:gpt-4o-mini:acme::abc123", O200K),
        ("gpt-4", CL100K),
        ("gpt-4-turbo", CL100K),
        ("gpt-4-0613", CL100K),
        ("gpt-3.5-turbo", CL100K),
        ("azure/gpt-35-turbo", CL100K),
        ("text-embedding-3-small", CL100K),
        ("claude-sonnet-4-20250514", O200K),
        ("anthropic/claude-3-5-sonnet", O200K),
        ("gemini/gemini-2.5-pro", O200K),
        ("totally-unknown", O200K),
        ("", O200K),
    ],
)
def test_encoding_for_model(model: str, encoding: str) -> None:
    assert encoding_name_for_model(model) == encoding


# ------------------------------------------------------------------ accuracy vs cookbook


def test_known_values_by_hand(counter: TokenCounter) -> None:
    # "system", "user" are 1 token each; "You are a helpful assistant." is
    # You|are|a|helpful|assistant|. = 6 and "What is the capital of France?" is 7, in both
    # encodings. (3+1+6) + (3+1+7) + 3 priming = 24; a name "bob" (1 token) adds 1+1.
    messages: list[Message] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert counter.count_request(messages, "gpt-4o") == 24
    assert counter.count_request(messages, "gpt-4") == 24
    messages[1]["name"] = "bob"
    assert counter.count_request(messages, "gpt-4o") == 26
    assert counter.count_message({"role": "user", "content": "Hello"}, "gpt-4o") == 5


def test_cookbook_published_example(counter: TokenCounter) -> None:
    # The cookbook's example conversation; the cookbook reports the same numbers from the API:
    # 129 prompt tokens for gpt-3.5-turbo/gpt-4, 124 for gpt-4o/gpt-4o-mini.
    example = [
        {
            "role": "system",
            "content": "You are a helpful, pattern-following assistant that translates "
            "corporate jargon into plain English.",
        },
        {
            "role": "system",
            "name": "example_user",
            "content": "New synergies will help drive top-line growth.",
        },
        {
            "role": "system",
            "name": "example_assistant",
            "content": "Things working well together will increase revenue.",
        },
        {
            "role": "system",
            "name": "example_user",
            "content": "Let's circle back when we have more bandwidth to touch base on "
            "opportunities for increased leverage.",
        },
        {
            "role": "system",
            "name": "example_assistant",
            "content": "Let's talk later when we're less busy about how to do better.",
        },
        {
            "role": "user",
            "content": "This late pivot means we don't have time to boil the ocean for the "
            "client deliverable.",
        },
    ]
    assert counter.count_request(example, "gpt-3.5-turbo") == 129
    assert counter.count_request(example, "gpt-4") == 129
    assert counter.count_request(example, "gpt-4o") == 124
    assert counter.count_request(example, "gpt-4o-mini") == 124


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4.1-mini", "gpt-4", "gpt-3.5-turbo"])
def test_matches_cookbook_on_text_conversations(
    counter: TokenCounter, seed: int, model: str
) -> None:
    messages = random_conversation(seed, 5 + seed * 15)
    expected = cookbook_num_tokens_from_messages(messages, encoding_name_for_model(model))
    got = counter.count_request(messages, model)
    assert abs(got - expected) <= 0.02 * expected
    # Text-only accounting is the cookbook's exactly; the 2 % is the contract, not the slack.
    assert got == expected


def test_content_parts_text_equals_string(counter: TokenCounter) -> None:
    as_string = {"role": "user", "content": "first part second part"}
    as_parts = {
        "role": "user",
        "content": [
            {"type": "text", "text": "first part"},
            {"type": "text", "text": " second part"},
        ],
    }
    assert counter.count_message(as_parts, "gpt-4o") == counter.count_message(as_string, "gpt-4o")


def test_special_token_text_does_not_raise(counter: TokenCounter) -> None:
    n = counter.count_message({"role": "user", "content": "<|endoftext|><|im_start|>"}, "gpt-4o")
    assert n > 5


# ------------------------------------------------------------------ tools


WEATHER_TOOLS: list[Message] = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "The city and state, e.g. San Francisco, CA",
                    },
                    "unit": {
                        "type": "string",
                        "description": "The unit of temperature to return",
                        "enum": ["celsius", "fahrenheit"],
                    },
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Relative path."}},
            },
        },
    },
]


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4"])
def test_count_tools_matches_cookbook_for_flat_schemas(counter: TokenCounter, model: str) -> None:
    encoding = encoding_name_for_model(model)
    assert counter.count_tools(WEATHER_TOOLS, model) == cookbook_num_tokens_for_tools(
        WEATHER_TOOLS, encoding
    )


def test_cookbook_published_tools_example(counter: TokenCounter) -> None:
    # Cookbook num_tokens_for_tools example (one weather function): 105 for gpt-3.5/gpt-4,
    # 101 for gpt-4o/gpt-4o-mini, both as counted and as reported by the API.
    messages = [
        {
            "role": "system",
            "content": "You are a helpful assistant that can answer to questions about the "
            "weather.",
        },
        {"role": "user", "content": "What's the weather like in San Francisco?"},
    ]
    assert counter.count_request(messages, "gpt-4", WEATHER_TOOLS[:1]) == 105
    assert counter.count_request(messages, "gpt-4o", WEATHER_TOOLS[:1]) == 101


def test_count_tools_nested_schema_counts_more(counter: TokenCounter) -> None:
    flat = [
        {
            "type": "function",
            "function": {
                "name": "edit",
                "description": "Edit files",
                "parameters": {
                    "type": "object",
                    "properties": {"edits": {"type": "array", "description": "Edits"}},
                },
            },
        }
    ]
    nested = [
        {
            "type": "function",
            "function": {
                "name": "edit",
                "description": "Edit files",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "edits": {
                            "type": "array",
                            "description": "Edits",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "path": {"type": "string"},
                                    "old_text": {"type": "string"},
                                    "new_text": {"type": "string"},
                                },
                            },
                        }
                    },
                },
            },
        }
    ]
    assert counter.count_tools(nested, "gpt-4o") > counter.count_tools(flat, "gpt-4o") + 10
    assert counter.count_tools([], "gpt-4o") == 0
    assert counter.count_tools(None, "gpt-4o") == 0
    custom = [{"type": "custom", "custom": {"name": "apply_patch", "description": "Patch"}}]
    assert counter.count_tools(custom, "gpt-4o") > tk.FUNC_END


def test_tool_calls_and_results(counter: TokenCounter) -> None:
    count = counter.count_text
    args = '{"city":"Paris"}'
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": args},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }
    expected_call = (
        tk.TOKENS_PER_MESSAGE
        + count("assistant", "gpt-4o")
        + 2 * tk.TOOL_CALL_OVERHEAD
        + count("get_weather", "gpt-4o")
        + count(args, "gpt-4o")
        + count("get_time", "gpt-4o")
        + count("{}", "gpt-4o")
    )
    assert counter.count_message(call, "gpt-4o") == expected_call
    result = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}
    expected_result = (
        tk.TOKENS_PER_MESSAGE
        + count("tool", "gpt-4o")
        + count("18 degrees, sunny", "gpt-4o")
        + tk.TOOL_RESULT_OVERHEAD
    )
    assert counter.count_message(result, "gpt-4o") == expected_result
    legacy = {"role": "assistant", "function_call": {"name": "get_weather", "arguments": args}}
    assert counter.count_message(legacy, "gpt-4o") == (
        tk.TOKENS_PER_MESSAGE
        + count("assistant", "gpt-4o")
        + tk.TOOL_CALL_OVERHEAD
        + count("get_weather", "gpt-4o")
        + count(args, "gpt-4o")
    )


def test_long_tool_arguments_are_counted(counter: TokenCounter) -> None:
    code = "print('hello world')\n" * 500
    call = {
        "role": "assistant",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "write", "arguments": code}}
        ],
    }
    assert counter.count_message(call, "gpt-4o") >= counter.count_text(code, "gpt-4o")


# ------------------------------------------------------------------ images


def png_data_url(width: int, height: int, padding: int = 0) -> str:
    """A real (decodable) grayscale PNG, built by hand with struct + zlib."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    raw = b"".join(b"\x00" + b"\x7f" * width for _ in range(height))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + (chunk(b"tEXt", b"pad\x00" + b"x" * padding) if padding else b"")
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def jpeg_data_url(width: int, height: int, exif_bytes: int) -> str:
    """JPEG headers only (SOI, big APPn segments, DQT, SOF0): exercises the segment walk."""
    segments = [b"\xff\xd8"]
    while exif_bytes > 0:  # a segment holds at most 65533 bytes
        size = min(exif_bytes, 60_000)
        app = b"Exif\x00\x00" + b"\x00" * size
        segments.append(b"\xff\xe1" + struct.pack(">H", len(app) + 2) + app)
        exif_bytes -= size
    segments += [
        b"\xff\xdb" + struct.pack(">H", 67) + b"\x00" * 65,
        b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00",
        b"\xff\xd9",
    ]
    return "data:image/jpeg;base64," + base64.b64encode(b"".join(segments)).decode()


def test_image_tile_rule() -> None:
    assert image_tokens(4096, 4096, "low") == 85
    assert image_tokens(1024, 1024, "high") == 765  # 768x768 -> 2x2 tiles
    assert image_tokens(1024, 1024, "auto") == 765
    assert image_tokens(2048, 4096, "high") == 1105  # 1024x2048 -> 768x1536 -> 2x3 tiles
    assert image_tokens(512, 512, "high") == 255  # no upscaling: one tile
    assert image_tokens(None, None, "high") == 765  # unknown size: documented 1024x1024
    assert image_tokens(4000, 1000, "high") == 765  # -> 2048x512, short side 512: 4x1 tiles
    assert image_tokens(3000, 1000, "high") == 1445  # -> 2048x682.7: 4x2 tiles
    assert image_tokens(1536, 1536, "high") == 765


def test_png_header_dimensions() -> None:
    url = png_data_url(600, 100)
    assert image_dimensions_from_data_url(url) == (600, 100)
    # 600x100 fits, shortest side 100 <= 768 -> 2x1 tiles -> 425.
    part = {"type": "image_url", "image_url": {"url": url, "detail": "high"}}
    assert tk._count_image_part(part) == 425


def test_other_image_formats() -> None:
    assert image_dimensions_from_data_url(jpeg_data_url(3000, 2000, 70_000)) == (3000, 2000)
    gif = b"GIF89a" + struct.pack("<HH", 320, 240) + b"\x00" * 20
    assert image_dimensions_from_data_url(
        "data:image/gif;base64," + base64.b64encode(gif).decode()
    ) == (320, 240)
    vp8x = b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\x0a\x00\x00\x00" + b"\x00" * 4
    vp8x += (1919).to_bytes(3, "little") + (1079).to_bytes(3, "little")
    assert image_dimensions_from_data_url(
        "data:image/webp;base64," + base64.b64encode(vp8x).decode()
    ) == (1920, 1080)
    assert image_dimensions_from_data_url("https://example.com/cat.png") is None
    assert image_dimensions_from_data_url("data:image/png;base64,not-really-base64!!") is None


def test_image_never_counted_by_base64_length(counter: TokenCounter) -> None:
    small = png_data_url(64, 64)
    big = png_data_url(64, 64, padding=3_000_000)  # ~4 MB of base64, same pixel size
    assert len(big) > 4_000_000

    def message(url: str, detail: str = "auto") -> Message:
        return {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this image?"},
                {"type": "image_url", "image_url": {"url": url, "detail": detail}},
            ],
        }

    base = counter.count_message({"role": "user", "content": "What is in this image?"}, "gpt-4o")
    assert counter.count_message(message(small), "gpt-4o") == base + 255
    assert counter.count_message(message(big), "gpt-4o") == base + 255
    assert counter.count_message(message(big, "low"), "gpt-4o") == base + 85
    remote = message("https://example.com/photo.jpg")
    assert counter.count_message(remote, "gpt-4o") == base + 765
    responses_style = {
        "role": "user",
        "content": [{"type": "input_image", "image_url": small, "detail": "high"}],
    }
    assert counter.count_message(responses_style, "gpt-4o") == 3 + 1 + 255


def test_audio_and_file_estimates(counter: TokenCounter) -> None:
    # 1 s of 16 kHz mono 16-bit WAV: byte rate 32000 -> 10 tokens (1 token / 100 ms).
    pcm = b"\x00\x00" * 16_000
    wav = (
        b"RIFF"
        + struct.pack("<I", 36 + len(pcm))
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, 16_000, 32_000, 2, 16)
        + b"data"
        + struct.pack("<I", len(pcm))
        + pcm
    )
    audio = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
    }
    assert tk._count_part(audio, len) == 10
    pdf = b"%PDF-1.4\n" + b"1 0 obj << /Type /Pages >> endobj\n" + b"<< /Type /Page >>\n" * 3
    file_part = {
        "type": "file",
        "file": {
            "filename": "a.pdf",
            "file_data": "data:application/pdf;base64," + base64.b64encode(pdf).decode(),
        },
    }
    filename_tokens = counter.count_text("a.pdf", "gpt-4o")
    count = counter._text_counter(O200K)
    assert tk._count_part(file_part, count) == 3 * media.PDF_TOKENS_PER_PAGE + filename_tokens
    by_id = {"type": "file", "file": {"file_id": "file-abc"}}
    assert tk._count_part(by_id, count) == tk.FILE_REFERENCE_TOKENS


# ------------------------------------------------------------------ cache


def test_cache_recounts_only_new_messages() -> None:
    tc = TokenCounter()
    history = random_conversation(42, 300)
    cold_start = time.perf_counter()
    first = tc.count_request(history, "gpt-4o")
    cold = time.perf_counter() - cold_start
    assert tc.cache_misses == len(history)
    assert tc.cache_hits == 0

    history.append({"role": "user", "content": "one more question about the code"})
    warm_start = time.perf_counter()
    second = tc.count_request(history, "gpt-4o")
    warm = time.perf_counter() - warm_start
    assert tc.cache_misses == len(history)  # exactly one new miss
    assert tc.cache_hits == len(history) - 1
    assert second == first + tc.count_message(history[-1], "gpt-4o")
    assert warm < cold  # hashing only

    # Same messages under another encoding are separate entries.
    tc.count_request(history, "gpt-4")
    assert tc.cache_misses == 2 * len(history)
    # Equal content in a new dict object (clients resend parsed JSON) still hits.
    copy = [dict(m) for m in history]
    hits = tc.cache_hits
    tc.count_request(copy, "gpt-4o")
    assert tc.cache_hits == hits + len(copy)


def test_cache_key_is_canonical_and_bounded() -> None:
    tc = TokenCounter(cache_size=10)
    a = {"role": "user", "content": "same"}
    b = {"content": "same", "role": "user"}  # key order differs, canonical bytes equal
    tc.count_message(a, "gpt-4o")
    tc.count_message(b, "gpt-4o")
    assert (tc.cache_misses, tc.cache_hits) == (1, 1)
    for i in range(20):
        tc.count_message({"role": "user", "content": f"message {i}"}, "gpt-4o")
    assert tc.cache_len == 10
    tc.count_message({"role": "user", "content": "message 0"}, "gpt-4o")  # evicted: LRU
    assert tc.cache_misses == 22
    tc.count_message({"role": "user", "content": "message 19"}, "gpt-4o")  # still cached
    assert tc.cache_hits == 2
    tc.clear_cache()
    assert (tc.cache_len, tc.cache_hits, tc.cache_misses) == (0, 0, 0)


def test_tools_are_cached() -> None:
    tc = TokenCounter()
    n = tc.count_tools(WEATHER_TOOLS, "gpt-4o")
    assert tc.count_tools(WEATHER_TOOLS, "gpt-4o") == n
    assert tc.cache_hits == 1


# ------------------------------------------------------------------ offline / fallbacks


class DownloadAttempted(AssertionError):
    pass


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> Any:
        raise DownloadAttempted(f"network/download attempted: {args!r}")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    try:
        import requests

        monkeypatch.setattr(requests, "get", refuse)
    except ImportError:
        pass
    # Forget encodings built earlier in this process so they must be loaded from disk again.
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)


def test_encodings_load_offline(no_network: None) -> None:
    tc = TokenCounter()
    messages: list[Message] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert tc.count_request(messages, "gpt-4o") == 24
    assert tc.count_request(messages, "gpt-4") == 24
    assert tc.encoding_name("gpt-4o") == O200K
    assert tc.encoding_name("gpt-3.5-turbo") == CL100K
    assert set(tiktoken.registry.ENCODINGS) >= {O200K, CL100K}  # really rebuilt from files
    assert tc.tiktoken_dir is not None
    assert tokenizer_data.tiktoken_dir_has(tc.tiktoken_dir)
    assert tc.count_tools(WEATHER_TOOLS, "gpt-4o") > 0


def test_ensure_offline_points_at_litellm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    directory = tokenizer_data.ensure_tiktoken_offline()
    assert directory is not None
    assert directory.parts[-3:] == ("litellm", "litellm_core_utils", "tokenizers")
    import os

    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(directory)
    for name in (O200K, CL100K):
        assert tokenizer_data.verify_tiktoken_file(directory, name)


def test_ensure_offline_keeps_valid_user_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in (O200K, CL100K):
        (tmp_path / tokenizer_data.tiktoken_cache_file_name(name)).write_bytes(b"x")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert tokenizer_data.ensure_tiktoken_offline() == tmp_path
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(empty))
    chosen = tokenizer_data.ensure_tiktoken_offline()
    assert chosen is not None and chosen != empty  # a dir without the files is overridden


def hide_litellm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "litellm":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    # tiktoken's default cache location must not rescue us either.
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))


def test_without_litellm_falls_back_to_estimate(
    no_network: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hide_litellm(monkeypatch, tmp_path)
    assert tokenizer_data.litellm_package_dir() is None
    assert tokenizer_data.litellm_model_map_path() is None
    assert tokenizer_data.ensure_tiktoken_offline() is None
    tc = TokenCounter()
    assert tc.encoding_name("gpt-4o") == ESTIMATE
    text = "x" * 40  # 40 bytes -> 10 tokens
    assert tc.count_message({"role": "user", "content": text}, "gpt-4o") == 3 + 1 + 10
    assert tc.count_request([{"role": "user", "content": text}], "gpt-4") == 3 + 1 + 10 + 3
    assert not tiktoken.registry.ENCODINGS


def test_corrupt_cache_files_never_trigger_download(
    no_network: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hide_litellm(monkeypatch, tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in (O200K, CL100K):
        (bad / tokenizer_data.tiktoken_cache_file_name(name)).write_bytes(b"garbage")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(bad))
    tc = TokenCounter()
    assert tc.count_request([{"role": "user", "content": "hello"}], "gpt-4o") > 0
    assert tc.encoding_name("gpt-4o") == ESTIMATE
    # tiktoken would have deleted a mismatching file before re-downloading it.
    assert all(p.read_bytes() == b"garbage" for p in bad.iterdir())


def test_use_tiktoken_false_is_estimate() -> None:
    tc = TokenCounter(use_tiktoken=False)
    assert tc.encoding_name("gpt-4o") == ESTIMATE
    assert tc.count_text("abcdefgh", "gpt-4o") == 2
    assert tc.count_text("é", "gpt-4o") == 1  # 2 utf-8 bytes, rounded up


def test_malformed_messages_do_not_crash(counter: TokenCounter) -> None:
    odd: list[Any] = [
        {"role": "user", "content": [{"type": "mystery", "blob": [1, 2, 3]}, "bare string", 7]},
        {"role": "assistant", "tool_calls": "not a list"},
        {"role": "assistant", "tool_calls": [{"id": "x"}, "junk"]},
        {"role": "user", "content": {"unexpected": "object"}},
        {"role": "user", "content": "x", "extra": {"k": "v"}, "flag": True},
    ]
    assert counter.count_request(odd, "gpt-4o") > 0


# ------------------------------------------------------------------ performance


def test_100k_token_history_cold_and_warm(counter: TokenCounter) -> None:
    counter.clear_cache()
    history = random_conversation(7, 1200)
    cold_start = time.perf_counter()
    total = counter.count_request(history, "gpt-4o")
    cold = time.perf_counter() - cold_start
    assert total > 90_000
    history.append({"role": "user", "content": "next"})
    warm_start = time.perf_counter()
    counter.count_request(history, "gpt-4o")
    warm = time.perf_counter() - warm_start
    assert cold < 2.0
    assert warm < cold


def test_older_encodings_load_on_first_use_off_the_event_loop(
    make_proxy: Any, fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up preloads only o200k (RSS); cl100k loads when a gpt-4 request first needs it,
    in a worker thread, and that request's counts are exact."""
    import threading

    import httpx

    loads: list[tuple[str, str]] = []
    original = tk.TokenCounter._load_encoding

    def recording(self: tk.TokenCounter, name: str) -> Any:
        if name not in self._encodings:
            loads.append((name, threading.current_thread().name))
        return original(self, name)

    monkeypatch.setattr(tk.TokenCounter, "_load_encoding", recording)
    srv = make_proxy()
    assert httpx.get(srv.url + "/healthz").status_code == 200
    text = "count these words, exactly as tiktoken does " * 20
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
        "model": "gpt-4", "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200
    cl100k = [thread for name, thread in loads if name == "cl100k_base"]
    assert len(cl100k) == 1 and cl100k[0] != f"asgi-{srv.port}", loads
    expected = len(tiktoken.get_encoding("cl100k_base").encode(text)) + 3 + 1 + 3
    assert int(r.headers["x-ctxproxy-tokens-in"]) == expected
