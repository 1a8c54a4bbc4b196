"""The documentation site (``docs/``, ``mkdocs.yml``) against the tree it describes.

* ``docs/architecture.md`` names modules, classes and functions in code type; each must exist
  (a path, or a name in a module its section names), every module of ``proxy/`` must be on one
  of its floors, and no module may import from a floor above its own: the page cannot go stale
  without this test saying where.
* Every source path a page gives in code type exists.
* Every ``docs/PAGE.md#anchor`` the code, the README, the changelog and config.example.yaml
  cite is a page and a heading of it (the code's docstrings point into the docs for what the
  project promises).
* No docstring or comment cites the old spec by section number any more.
* ``docs/configuration.md`` holds the reference :mod:`harness.config_reference` renders from
  :class:`proxy.config.Config` now, so it lists every field.
* ``mkdocs build --strict`` passes: no broken link or anchor, no page left out of the nav.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import io
import os
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from markdown.extensions.toc import slugify

from harness import config_reference
from proxy.config import Config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"

_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_PATH = re.compile(r"(proxy|harness|tests|bench)/[\w./-]*")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?")
# Dotted tokens that are file names, not Python names.
_FILE_SUFFIXES = {"md", "jsonl", "txt", "html", "css", "yaml", "yml", "toml", "json", "sqlite3",
                  "py", "sh"}


def code_spans(markdown: str) -> list[str]:
    """The inline code spans of a page, outside fenced blocks."""
    return [m.group(2).strip() for m in _CODE.finditer(_FENCE.sub("", markdown))]


@dataclass
class Section:
    title: str
    floor: int | None
    tokens: list[str] = field(default_factory=list)


def sections(markdown: str) -> list[Section]:
    """The page split at its ``## `` headings; a floor's heading is ``## Floor N: ...``."""
    found = [Section("(intro)", None)]
    for chunk in re.split(r"^## ", _FENCE.sub("", markdown), flags=re.M)[1:]:
        title = chunk.splitlines()[0].strip()
        floor = re.match(r"Floor (\d+)\b", title)
        found.append(Section(title, int(floor.group(1)) if floor else None,
                             code_spans("## " + chunk)))
    found[0].tokens = code_spans(re.split(r"^## ", _FENCE.sub("", markdown), flags=re.M)[0])
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(token: str) -> list[str]:
    """The modules a path token names: one file, or every module below a folder."""
    path = ROOT / token
    if path.is_file() and path.suffix == ".py":
        return [module_name(path)]
    if path.is_dir():
        return sorted(module_name(p) for p in path.rglob("*.py") if "__pycache__" not in p.parts)
    return []


@cache
def imported(name: str) -> ModuleType | None:
    if importlib.util.find_spec(name.rsplit(".", 1)[0] if "." in name else name) is None:
        return None
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def resolve_dotted(token: str) -> bool:
    """A dotted name: a module and attributes (``proxy.demo.fake.upstream.FakeUpstream``,
    ``offload.stage.Offloader``, ``Archive.record_request`` is a bare name's job), or a
    configuration field (``storage.url``)."""
    token = token.removesuffix("()")
    parts = token.split(".")
    heads = [parts] if parts[0] in ("proxy", "harness") else [["proxy", *parts]]
    for candidate in heads:
        for cut in range(len(candidate), 0, -1):
            module = imported(".".join(candidate[:cut]))
            if module is None:
                continue
            obj: Any = module
            for attr in candidate[cut:]:
                if not hasattr(obj, attr):
                    break
                obj = getattr(obj, attr)
            else:
                return True
            break
    return config_field(parts)


def config_field(parts: list[str]) -> bool:
    model: Any = Config
    for part in parts:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        annotation = fields[part].annotation
        inner = [m for _, m in config_reference._models_of(annotation)]
        model = inner[0] if inner else None
    return True


def resolve_bare(name: str, modules: list[str]) -> bool:
    """A bare name: an attribute of a module its section names, or a method of a class in
    one of them."""
    name = name.removesuffix("()")
    for module_path in modules:
        module = imported(module_path)
        if module is None:
            continue
        if hasattr(module, name):
            return True
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and hasattr(cls, name):
                return True
    return False


def unresolved(section: Section) -> list[str]:
    modules = [m for token in section.tokens if _PATH.fullmatch(token)
               for m in modules_under(token)]
    problems = []
    for token in section.tokens:
        if _PATH.fullmatch(token):
            if not (ROOT / token).exists():
                problems.append(f"{section.title}: no such path {token}")
            continue
        if not _DOTTED.fullmatch(token) or token.rsplit(".", 1)[-1] in _FILE_SUFFIXES:
            continue  # a header, a route, a file name, a snippet: not a name in the code
        ok = resolve_dotted(token) if "." in token.removesuffix("()") else (
            resolve_bare(token, modules) or config_field([token]))
        if not ok:
            problems.append(f"{section.title}: `{token}` names nothing in "
                            f"{', '.join(modules) or 'no module of its section'}")
    return problems


def test_architecture_names_exist() -> None:
    problems = [p for section in sections(ARCHITECTURE.read_text()) for p in unresolved(section)]
    assert not problems, "\n".join(problems)


def floors() -> dict[str, int]:
    """The floor of every module the page places: a file named on a floor, else the floor of
    the folder it is in."""
    by_folder: dict[str, int] = {}
    by_file: dict[str, int] = {}
    for section in sections(ARCHITECTURE.read_text()):
        if section.floor is None:
            continue
        for token in section.tokens:
            if not _PATH.fullmatch(token):
                continue
            target = by_file if (ROOT / token).is_file() else by_folder
            for module in modules_under(token):
                target.setdefault(module, section.floor)
    return by_folder | by_file


def package_modules() -> list[str]:
    return modules_under("proxy/")


def imports_of(module: str) -> Iterator[str]:
    """What a module imports from ``proxy``, for running (an ``if TYPE_CHECKING:`` block's
    imports are for the type checker only)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())

    def walk(node: ast.AST) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (n for orelse in child.orelse for n in [orelse, *walk(orelse)])
                continue
            yield child
            yield from walk(child)

    known = set(package_modules())
    for node in walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("proxy"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            yield from [n for n in names if n in known] or [node.module]
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("proxy"))


def floor_of(module: str, placed: dict[str, int]) -> int | None:
    if module in placed:
        return placed[module]
    below = [floor for name, floor in placed.items() if name.startswith(module + ".")]
    return min(below) if below else None  # a package's unplaced __init__


def test_every_module_is_on_a_floor() -> None:
    placed = floors()
    missing = [m for m in package_modules() if floor_of(m, placed) is None]
    assert not missing, f"modules no floor of docs/architecture.md names: {missing}"


def test_no_module_imports_from_a_floor_above() -> None:
    placed = floors()
    problems = []
    for module in package_modules():
        mine = floor_of(module, placed)
        for target in imports_of(module):
            theirs = floor_of(target, placed)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{module} (floor {mine}) imports {target} (floor {theirs})")
    assert not problems, "\n".join(sorted(set(problems)))


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_source_paths_in_the_docs_exist() -> None:
    problems = []
    for page in pages():
        for token in code_spans(page.read_text()):
            for match in re.finditer(r"(?<![\w/.])(?:proxy|harness|tests|bench)/[\w./-]*\w/?",
                                     token):
                path = match.group(0)
                if "<" in token or "*" in path:
                    continue
                if not (ROOT / path).exists():
                    problems.append(f"{page.name}: {path}")
    assert not problems, "paths the docs name that do not exist:\n" + "\n".join(problems)


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings, as the toc extension makes them (duplicates get _1...)."""
    seen: dict[str, int] = {}
    ids = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if not heading:
            continue
        text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
        slug = slugify(text.replace("*", ""), "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if not count else f"{slug}_{count}")
    return ids


_CITATION = re.compile(r"(?<![\w/.-])docs/([a-z0-9-]+\.md)(?:#([\w-]+))?")


def prose_of(path: Path) -> str:
    """What a file says in prose: a markdown file whole, a Python file's docstrings and comments
    (its string literals are data: a test may name a markdown file of its own)."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def cited() -> Iterator[tuple[str, str, str | None]]:
    sources = [*ROOT.glob("README.md"), *ROOT.glob("CHANGELOG.md"), ROOT / "bench" / "README.md",
               ROOT / "config.example.yaml"]
    for folder in ("proxy", "harness", "tests", "bench"):
        sources += [p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    for source in sources:
        for match in _CITATION.finditer(prose_of(source)):
            yield str(source.relative_to(ROOT)), match.group(1), match.group(2)


def test_docs_the_code_cites_exist() -> None:
    problems = []
    found = 0
    for source, page, anchor in cited():
        found += 1
        path = DOCS / page
        if not path.is_file():
            problems.append(f"{source}: docs/{page} does not exist")
        elif anchor and anchor not in anchors(path):
            problems.append(f"{source}: docs/{page} has no heading #{anchor}")
    assert found > 40  # the docstrings cite the docs: this test must have something to check
    assert not problems, "\n".join(problems)


def test_no_old_spec_section_numbers() -> None:
    word = "SP" + "EC"  # spelt apart so this file does not match itself
    pattern = re.compile(rf"\b{word}\b(?: sections?)? ?\d")
    hits = []
    for folder in ("proxy", "harness", "tests", "bench"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and "__pycache__" not in path.parts:
                for number, line in enumerate(path.read_text().splitlines(), 1):
                    if pattern.search(line) or re.search(rf"\b{word}\b", line):
                        hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "cite the docs page instead:\n" + "\n".join(hits)


def test_configuration_reference_is_current() -> None:
    page = (DOCS / "configuration.md").read_text()
    assert config_reference.current(page) == config_reference.render(), (
        "docs/configuration.md is stale: run python -m harness.config_reference --write")


def test_configuration_reference_lists_every_field() -> None:
    page = (DOCS / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    headings = set(re.findall(r"^### `([^`]+)`", page, re.M))
    missing = []
    for path in config_reference.field_paths():
        parent, _, name = path.rpartition(".")
        if name not in rows or (parent and parent not in headings):
            missing.append(path)
    assert len(config_reference.field_paths()) > 100
    assert not missing, f"fields docs/configuration.md does not list: {missing}"


def test_mkdocs_builds_strictly(tmp_path: Path) -> None:
    for package in ("mkdocs", "material"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install -e '.[dev]')")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()
