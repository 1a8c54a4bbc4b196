"""What the provider billed for one call, read from its ``usage`` in any wire format (pure).

Providers count the same things under different names and with different inclusions:

==================  ======================================  =====================================
format              the prompt                              cached / written
==================  ======================================  =====================================
chat completions    ``prompt_tokens`` (includes cached)     ``prompt_tokens_details.cached_tokens``
Responses           ``input_tokens`` (includes cached)      ``input_tokens_details.cached_tokens``
Anthropic Messages  ``input_tokens`` (excludes both)        ``cache_read_input_tokens``,
                                                            ``cache_creation_input_tokens`` (its
                                                            ``cache_creation`` 5m / 1h split)
==================  ======================================  =====================================

:class:`Usage` holds them in one shape where the four input parts are disjoint and add up to
the prompt, so a price applies to each without knowing where it came from. OpenAI bills no
cache writes (its uncached input is ``input``); OpenAI-compatible answers that carry
Anthropic's names (litellm's translation of an Anthropic answer) are read with them, their
``prompt_tokens`` taken to include the cache parts as OpenAI's does.

Anthropic's server-side compaction (``compact_*`` edits) samples more than once per request and
reports each sampling in ``usage.iterations``; the top-level counts are then the last
iteration's only, and what is billed is their sum: so the iterations are summed when present.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["Usage", "parse_usage"]


def _int(value: Any) -> int | None:
    # bool is an int subclass, and a provider's null means "not reported".
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return max(0, int(value))


def _get(obj: Any, *path: str) -> int | None:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return _int(obj)


@dataclass(frozen=True, slots=True)
class Usage:
    """One call's billed tokens. The input parts are disjoint: ``prompt`` is their sum."""

    input: int = 0  # input tokens at the base price: neither read from nor written to a cache
    cache_read: int = 0  # input tokens read from the prompt cache
    cache_write_5m: int = 0  # input tokens written to the cache, 5-minute TTL
    cache_write_1h: int = 0  # input tokens written to the cache, 1-hour TTL
    output: int = 0  # output tokens, reasoning included
    reasoning: int = 0  # of ``output``, reasoning / thinking (shown, not priced apart)
    iterations: int = 0  # samplings summed from Anthropic's usage.iterations (0: none reported)

    @property
    def cache_write(self) -> int:
        return self.cache_write_5m + self.cache_write_1h

    @property
    def prompt(self) -> int:
        """Every input token of the call, however it was billed."""
        return self.input + self.cache_read + self.cache_write_5m + self.cache_write_1h

    @property
    def cached_share(self) -> float:
        """The share of the prompt read from the cache (0 for an empty prompt)."""
        prompt = self.prompt
        return self.cache_read / prompt if prompt else 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input + other.input, self.cache_read + other.cache_read,
            self.cache_write_5m + other.cache_write_5m, self.cache_write_1h + other.cache_write_1h,
            self.output + other.output, self.reasoning + other.reasoning,
            self.iterations + other.iterations,
        )

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _FIELDS if getattr(self, name)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Usage:
        return cls(**{name: _int(data.get(name)) or 0 for name in _FIELDS})


_FIELDS: Final = ("input", "cache_read", "cache_write_5m", "cache_write_1h", "output",
                  "reasoning", "iterations")


def _openai(usage: Mapping[str, Any], prompt_key: str, output_key: str,
            details_key: str, output_details_key: str) -> Usage | None:
    prompt = _int(usage.get(prompt_key))
    output = _int(usage.get(output_key))
    if prompt is None and output is None:
        return None
    cached = (_get(usage, details_key, "cached_tokens") or _int(usage.get("cache_read_input_tokens"))
              or 0)
    written = (_int(usage.get("cache_creation_input_tokens"))
               or _get(usage, details_key, "cache_write_tokens")
               or _get(usage, details_key, "cache_creation_tokens") or 0)
    prompt = prompt or 0
    # Never more cache than prompt: a provider's detail that exceeds its own total is trusted
    # for the total (what is billed at all) and clipped in the parts.
    cached = min(cached, prompt)
    written = min(written, prompt - cached)
    reasoning = (_get(usage, output_details_key, "reasoning_tokens")
                 or _int(usage.get("reasoning_tokens")) or 0)
    return Usage(input=prompt - cached - written, cache_read=cached, cache_write_5m=written,
                 output=output or 0, reasoning=reasoning)


def _anthropic_one(usage: Mapping[str, Any]) -> Usage | None:
    fields = ("input_tokens", "output_tokens", "cache_read_input_tokens",
              "cache_creation_input_tokens")
    if all(_int(usage.get(f)) is None for f in fields):
        return None
    written = _int(usage.get("cache_creation_input_tokens")) or 0
    five = _get(usage, "cache_creation", "ephemeral_5m_input_tokens")
    hour = _get(usage, "cache_creation", "ephemeral_1h_input_tokens")
    if five is None and hour is None:
        five, hour = written, 0  # no split reported: the default TTL, 5 minutes
    else:
        five, hour = five or 0, hour or 0
    reasoning = (_get(usage, "output_tokens_details", "thinking_tokens")
                 or _get(usage, "output_tokens_details", "reasoning_tokens") or 0)
    return Usage(input=_int(usage.get("input_tokens")) or 0,
                 cache_read=_int(usage.get("cache_read_input_tokens")) or 0,
                 cache_write_5m=five, cache_write_1h=hour,
                 output=_int(usage.get("output_tokens")) or 0, reasoning=reasoning)


def _anthropic(usage: Mapping[str, Any]) -> Usage | None:
    iterations = usage.get("iterations")
    if isinstance(iterations, list) and iterations:
        parts = [u for u in (_anthropic_one(i) for i in iterations if isinstance(i, Mapping))
                 if u is not None]
        if parts:
            total = Usage()
            for part in parts:
                total = total + part
            return Usage(total.input, total.cache_read, total.cache_write_5m,
                         total.cache_write_1h, total.output, total.reasoning, len(parts))
    return _anthropic_one(usage)


def parse_usage(api: str, usage: Any) -> Usage | None:
    """The billed tokens of one answer's ``usage`` object in wire format ``api`` ("chat",
    "responses", "messages"); None when it reports none."""
    if not isinstance(usage, Mapping):
        return None
    if api == "messages":
        return _anthropic(usage)
    if api == "responses":
        return _openai(usage, "input_tokens", "output_tokens", "input_tokens_details",
                       "output_tokens_details")
    return _openai(usage, "prompt_tokens", "completion_tokens", "prompt_tokens_details",
                   "completion_tokens_details")
