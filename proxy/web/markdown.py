"""Summaries as HTML: CommonMark (markdown-it-py), safe for text the model wrote.

A summary is the summarizer model's output, and the model read the session's tool output: its
text is untrusted. So raw HTML in it is shown as text (``html: False``), a link to a
``javascript:``, ``vbscript:``, ``file:`` or any ``data:`` URL is refused (it stays as its literal
text), links carry ``rel="nofollow noopener noreferrer"``, images are not rendered (a page of
ours fetches nothing), and headings are moved down so a summary's ``#`` never competes with the
page's own ``<h1>``.
"""

from __future__ import annotations

import re
from typing import Final

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore

__all__ = ["Markdown"]

_BAD_SCHEME: Final = re.compile(r"^\s*(?:javascript|vbscript|file|data):", re.IGNORECASE)


class _Parser(MarkdownIt):
    def validateLink(self, url: str) -> bool:  # noqa: N802 (markdown-it's name)
        # markdown-it's own check lets data:image/* through; no data: URL is needed here.
        return _BAD_SCHEME.match(url) is None


class Markdown:
    """One configured parser (thread-safe: each render has its own state)."""

    def __init__(self, *, heading_shift: int = 2) -> None:
        md = _Parser("commonmark", {"html": False, "linkify": False, "typographer": False})
        md.enable(["table", "strikethrough"]).disable("image")
        shift = heading_shift

        def shift_headings(state: StateCore) -> None:
            for token in state.tokens:
                if token.type in ("heading_open", "heading_close"):
                    token.tag = f"h{min(6, int(token.tag[1:]) + shift)}"
                elif token.type == "inline":
                    for child in token.children or ():
                        if child.type == "link_open":
                            child.attrSet("rel", "nofollow noopener noreferrer")

        md.core.ruler.push("ctxproxy_page", shift_headings)
        self._md = md

    def render(self, text: str) -> str:
        """``text`` as an HTML fragment (every character of the input escaped or parsed)."""
        html: str = self._md.render(text)
        return html
