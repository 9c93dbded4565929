"""Crash-safe file primitives shared by the storage modules (store, checkpoints, logs).

``atomic_write`` leaves either the old file or the complete new one, never a partial file: the
data goes to a hidden temp file in the same folder, is fsynced and renamed over the target with
``os.replace``, and the folder is fsynced so the rename survives a power loss too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from pathlib import Path

_CHUNK = 1 << 20


def fsync_dir(directory: Path) -> None:
    """Persist a rename (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, os.replace, fsync the folder; no partial file remains."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o644)  # mkstemp creates 0600; run files are meant to be shared
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def remove_stale_temps(folder: Path, pattern: str = "*") -> list[Path]:
    """Delete temp files of ``atomic_write`` calls a kill interrupted (``.<name>.tmp-*`` for names
    matching ``pattern``). Only for a folder this process owns (the run lock)."""
    stale = sorted(folder.glob(f".{pattern}.tmp-*")) if folder.is_dir() else []
    for path in stale:
        with contextlib.suppress(OSError):
            path.unlink()
    return stale


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, *, fsync: bool = False) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of a file, read in chunks; ``fsync`` also flushes it to disk."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        if fsync:
            os.fsync(handle.fileno())
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def folder_bytes(folder: Path) -> int:
    """Total size of the files under ``folder`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def is_disk_full(error: BaseException) -> bool:
    """The error is the file system running out of space (ENOSPC / EDQUOT), however the writing
    library wrapped it (safetensors and torch.save report it as their own exception types)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(error) or "Disk quota exceeded" in str(error)


def hub_id_like(text: str) -> bool:
    """``org/name`` as a Hugging Face hub id is written (not a path: no leading ``/``, ``.`` or
    ``~``, one slash); a folder of that name, where one exists, is still a folder."""
    return not text.startswith(("/", ".", "~")) and text.count("/") == 1
