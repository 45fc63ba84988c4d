"""Small C helpers compiled on first use with the system's `cc`, loaded with ctypes (which releases the GIL for
each call); every caller keeps a Python path for machines without a compiler, and the tests run both.

The library is built once into a per-user cache keyed by the source's hash (about 0.1 s) and shared between
processes (an atomic rename: concurrent first uses each build, one wins). `CACHEDEMB_NATIVE=0` (or the caller's
own switch) turns them off. Where a compiler is at hand but a helper does not build or load, a RuntimeWarning
says which (once per process and file): the callers' torch code gives the same results, only slower.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

_LOADED: dict[Path, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cachedemb"


def _digest(source: Path) -> str:
    """The build's key: the source and the local headers it includes (`#include "x.h"`, beside it), so a changed
    header builds anew."""
    text = source.read_bytes()
    h = hashlib.sha256(text)
    for line in text.decode(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("#include") and '"' in line:
            header = source.with_name(line.split('"')[1])
            h.update(header.read_bytes() if header.is_file() else b"")
    return h.hexdigest()[:16]


def load_c(source: Path) -> ctypes.CDLL | None:
    """The compiled library of a C file, or None (no compiler, Windows, the build failed, or disabled)."""
    source = Path(source)
    if source in _LOADED:
        return _LOADED[source]
    lib = None
    if os.environ.get("CACHEDEMB_NATIVE", "1") != "0" and sys.platform != "win32" and source.is_file():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is not None:
            digest = _digest(source)
            target = _cache_dir() / f"{source.stem}-{digest}-{sys.platform}.so"
            try:
                if not target.is_file():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                        built = Path(tmp) / target.name
                        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)], check=True,
                                       capture_output=True, timeout=60)
                        os.replace(built, target)
                lib = ctypes.CDLL(str(target))
            except (OSError, subprocess.SubprocessError) as error:
                lib = None
                _warn_unbuilt(source, cc, error)
    _LOADED[source] = lib
    return lib


def _warn_unbuilt(source: Path, cc: str, error: Exception) -> None:
    """A compiler is here but the helper did not build or load: the results stay the same (the callers run their
    torch code), only slower, so say so once rather than leave a user to find the step times out of line."""
    detail = getattr(error, "stderr", None)
    if isinstance(detail, bytes):
        detail = detail.decode(errors="replace")
    lines = [line.strip() for line in (detail or str(error)).splitlines() if line.strip()]
    first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else str(error))
    warnings.warn(f"cachedemb: the C helper {source.name} did not build or load with {cc} ({first}); its "
                  "callers run their torch code instead (the same results, slower). CACHEDEMB_NATIVE=0 turns the "
                  "C helpers off.", RuntimeWarning, stacklevel=3)


class CFunctions:
    """A C file's functions with their ctypes signatures ({name: (argtypes, restype)}), built and typed on first
    use; `get()` is None where the file cannot be built (each caller keeps its own switch for the tests)."""

    def __init__(self, source: Path, signatures: dict):
        self.source, self.signatures = Path(source), signatures
        self._lib, self._tried = None, False

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:
            self._tried = True
            lib = load_c(self.source)
            if lib is not None:
                for name, (args, result) in self.signatures.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, result
            self._lib = lib
        return self._lib
