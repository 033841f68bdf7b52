"""The per-user wanspec cache folder and memoised file hashes (the keys of converted GGUFs)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, cast

__all__ = ["cache_dir", "file_sha256"]

_HASH_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Per-user cache: $WANSPEC_CACHE_DIR, else $XDG_CACHE_HOME/wanspec, else ~/.cache/wanspec."""
    env = os.environ.get("WANSPEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "wanspec"


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, memoised per (resolved path, size, mtime_ns) in the cache folder."""
    path = path.resolve()
    st = path.stat()
    key = str(path)
    index_path = cache_dir() / "hashes.json"
    index: dict[str, Any] = {}
    try:
        loaded = json.loads(index_path.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            index = loaded
    except (OSError, ValueError):
        index = {}  # missing or corrupt index: just rehash
    entry = index.get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return cast(str, entry["sha256"])
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    sha = digest.hexdigest()
    index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    with contextlib.suppress(OSError):  # the memo is an optimisation only
        _atomic_write_text(index_path, json.dumps(index, indent=1, sort_keys=True))
    return sha
