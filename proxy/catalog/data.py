"""Locate data files bundled inside the installed litellm package, without importing it.

litellm ships two things the proxy needs at run time and must never download:

* the tiktoken BPE files (``litellm/litellm_core_utils/tokenizers/<sha1 of download URL>``).
  tiktoken names its cache files exactly that way, so pointing ``TIKTOKEN_CACHE_DIR`` at that
  directory makes ``tiktoken.get_encoding`` load them from disk instead of fetching them;
* the model map ``model_prices_and_context_window_backup.json`` (context windows per model).

Importing litellm costs seconds, so its location is found with ``importlib.util.find_spec``,
which for a top-level package only searches ``sys.path`` and executes nothing.

Every function here returns ``None`` when the data is unavailable (litellm not installed, files
missing); callers then fall back to estimates instead of crashing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import orjson

__all__ = [
    "TIKTOKEN_SHA256",
    "TIKTOKEN_URLS",
    "ensure_tiktoken_offline",
    "litellm_model_map_path",
    "litellm_package_dir",
    "tiktoken_cache_file_name",
    "tiktoken_dir_has",
    "verify_tiktoken_file",
]

# The download URLs tiktoken (tiktoken_ext/openai_public.py) uses for the encodings the proxy
# counts with. The cache file name is derived from them rather than hard-coding the hashes, so a
# typo cannot silently point at a missing file.
TIKTOKEN_URLS: dict[str, str] = {
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
}

# sha256 tiktoken expects for each file (same values as tiktoken_ext/openai_public.py). tiktoken
# deletes a cached file whose hash does not match and downloads it again; checking first lets the
# counter fall back to an estimate instead of ever reaching for the network.
TIKTOKEN_SHA256: dict[str, str] = {
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
}

_DEFAULT_ENCODINGS: tuple[str, ...] = tuple(TIKTOKEN_URLS)
_MODEL_MAP_NAME = "model_prices_and_context_window_backup.json"
_TOKENIZERS_SUBDIR = ("litellm_core_utils", "tokenizers")


def tiktoken_cache_file_name(encoding: str) -> str:
    """Name tiktoken gives the cache file of ``encoding``: sha1 of its download URL."""
    return hashlib.sha1(TIKTOKEN_URLS[encoding].encode()).hexdigest()


def tiktoken_dir_has(directory: Path, encodings: Iterable[str] = _DEFAULT_ENCODINGS) -> bool:
    """True when ``directory`` holds a non-empty cache file for every encoding in ``encodings``."""
    try:
        for name in encodings:
            path = directory / tiktoken_cache_file_name(name)
            if not path.is_file() or path.stat().st_size == 0:
                return False
    except (OSError, KeyError):
        return False
    return True


def verify_tiktoken_file(directory: Path, encoding: str) -> bool:
    """True when the cache file of ``encoding`` in ``directory`` has the hash tiktoken expects.

    Costs one read and sha256 of a few MB (~5-20 ms); done once per encoding per counter.
    """
    expected = TIKTOKEN_SHA256.get(encoding)
    if expected is None:
        return False
    try:
        data = (directory / tiktoken_cache_file_name(encoding)).read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == expected


def litellm_package_dir() -> Path | None:
    """Directory of the installed litellm package, or None. Does not import litellm."""
    try:
        spec = importlib.util.find_spec("litellm")
    except (ImportError, ValueError):
        # ValueError: sys.modules["litellm"] exists with __spec__ None (e.g. a test stub).
        return None
    if spec is None:
        return None
    locations = spec.submodule_search_locations
    if locations:
        for location in locations:
            path = Path(location)
            if path.is_dir():
                return path
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        parent = Path(spec.origin).parent
        if parent.is_dir():
            return parent
    return None


def _litellm_tokenizers_dir() -> Path | None:
    package = litellm_package_dir()
    if package is None:
        return None
    directory = package.joinpath(*_TOKENIZERS_SUBDIR)
    return directory if directory.is_dir() else None


def ensure_tiktoken_offline(encodings: Iterable[str] = _DEFAULT_ENCODINGS) -> Path | None:
    """Make tiktoken load ``encodings`` from local files; return that directory or None.

    Must run before the first ``tiktoken.get_encoding`` of those encodings (tiktoken reads the
    environment variable at load time). Order of preference:

    1. ``TIKTOKEN_CACHE_DIR`` already set by the user to a directory holding the files: kept.
    2. litellm's bundled tokenizers directory: ``TIKTOKEN_CACHE_DIR`` is set to it.
    3. tiktoken's default cache (``$DATA_GYM_CACHE_DIR`` or ``<tmp>/data-gym-cache``) if it was
       already populated: ``TIKTOKEN_CACHE_DIR`` is set to it, so an unrelated user setting
       cannot send tiktoken to the network.

    Returns None when no directory holds all files. The caller must then not call
    ``tiktoken.get_encoding`` for them (it would download) and estimate instead.
    """
    wanted = tuple(encodings)
    user_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
    if user_dir and tiktoken_dir_has(Path(user_dir), wanted):
        return Path(user_dir)

    candidates: list[Path] = []
    bundled = _litellm_tokenizers_dir()
    if bundled is not None:
        candidates.append(bundled)
    data_gym = os.environ.get("DATA_GYM_CACHE_DIR")
    if data_gym:
        candidates.append(Path(data_gym))
    candidates.append(Path(tempfile.gettempdir()) / "data-gym-cache")

    for directory in candidates:
        if tiktoken_dir_has(directory, wanted):
            os.environ["TIKTOKEN_CACHE_DIR"] = str(directory)
            return directory
    return None


def litellm_model_map_path() -> Path | None:
    """Path of litellm's bundled model map JSON, or None when litellm or the file is missing."""
    package = litellm_package_dir()
    if package is None:
        return None
    path = package / _MODEL_MAP_NAME
    return path if path.is_file() else None


def read_litellm_model_map() -> object | None:
    """litellm's bundled model map, parsed (3.5 MB, ~12 ms): read once at start-up for every
    table made from it (context windows, prices); None when it is missing or unreadable."""
    path = litellm_model_map_path()
    if path is None:
        return None
    try:
        document: object = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return document
