"""Crash-safe checkpoint files: a save is atomic and durable, a load never runs code.

A training job killed mid-save (preemption, OOM killer, SIGKILL) must still find its previous checkpoint whole.
`save_checkpoint` writes to a temporary file in the target's directory (same file system, so the rename is
atomic), fsyncs it, renames it over the target with `os.replace`, then fsyncs the directory so the rename itself
survives a power loss. At every instant the target path holds either the old checkpoint or the new one.

`load_checkpoint` reads with `torch.load(weights_only=True)`: tensors, numbers, strings and containers only, so a
checkpoint from an untrusted place cannot execute code while it is unpickled.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch


def save_checkpoint(obj, path: str | os.PathLike) -> None:
    """Write `obj` (a state dict: tensors, numbers, strings, containers) to `path` atomically and durably.
    The directory must exist. A crash at any point leaves `path` as it was before, or fully written."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def load_checkpoint(path: str | os.PathLike, map_location="cpu"):
    """Read a checkpoint written by `save_checkpoint` (or any `torch.save` of plain state) without unpickling
    code: `torch.load(weights_only=True)`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} not found")
    return torch.load(path, map_location=map_location, weights_only=True)


def fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable (POSIX: the directory entry lives in the directory's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

