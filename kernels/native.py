"""The package's C helpers: one shared library, `cachedemb/_native*.so`, built by the package build (setup.py)
where a compiler is at hand and loaded here with ctypes (which releases the GIL for each call).

Nothing is compiled or written at run time, and the library is loaded from the package directory only (its
name carries the interpreter's platform tag, so a library built for another machine is never picked up). Each
helper module declares its C functions with `Helper(name, signatures)` and asks `helper.get()` for them: the
library with those functions typed, or None, and the caller runs its torch / numpy / Python code, which stays
the reference the tests compare against. None where
- the package was installed without the library (no compiler at build time, or CACHEDEMB_BUILD_NATIVE=0);
- the library was built from other C sources than the source tree beside it holds (an editable install whose C
  changed since: `pip install -e .` or scripts/setup_env.sh rebuilds it; a RuntimeWarning says so, once);
- `CACHEDEMB_NATIVE=0` is set (every helper: the one run-time switch);
- the helper's name is in `CACHEDEMB_NATIVE_DISABLE` (comma-separated, e.g. `host_sort,rowio`: for timing one
  helper against its pure path, scripts/bench_native.py), or a test set the helper's `enabled` to False.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path

_STEM = "_native"
# The helpers, by the names `Helper` and CACHEDEMB_NATIVE_DISABLE take (each its C file's stem).
NAMES = ("host_map", "host_rows", "host_sgd", "place_native", "pool_native", "record_copy", "row_index", "rowio",
         "slab_victims")
_state: dict = {}  # "lib": the loaded library or None, "why": why it is None
_LOCK = threading.Lock()
HELPERS: dict[str, Helper] = {}


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("cachedemb")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def library_path() -> Path | None:
    """The library file in the package directory for this interpreter, or None (not built)."""
    pkg = _package_dir()
    if pkg is None:
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = pkg / f"{_STEM}{suffix}"
        if path.is_file():
            return path
    return None


def _stale(lib: ctypes.CDLL, pkg: Path) -> str | None:
    """Where the library was built from other sources than a source tree beside the package holds (an editable
    install), the first such file; None for an installed wheel (no sources) or a library that matches."""
    root = pkg.parent
    if not (root / "setup.py").is_file():
        return None
    fn = lib.cemb_build_sources
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    for entry in fn().decode().split(";"):
        path, _, digest = entry.partition("=")
        source = root / path
        if not source.is_file() or hashlib.sha256(source.read_bytes()).hexdigest()[:16] != digest:
            return path
    return None


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (see `status()` for why); loaded once per process."""
    with _LOCK:
        if "why" not in _state:
            _state["lib"], _state["why"] = _load()
    return _state["lib"]


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if sys.platform == "win32":
        return None, "the C helpers are built on Linux and macOS only"
    path = library_path()
    if path is None:
        return None, "not built: the package was installed without a C compiler (or with CACHEDEMB_BUILD_NATIVE=0)"
    try:
        lib = ctypes.CDLL(str(path))
        changed = _stale(lib, path.parent)
    except (OSError, AttributeError) as error:
        why = f"{path.name} did not load ({error})"
    else:
        if changed is None:
            return lib, None
        why = (f"{path.name} was built from another {changed} than the source tree holds: `pip install -e .` (or "
               "scripts/setup_env.sh) rebuilds it")
    _warn(why)
    return None, why


def _warn(why: str) -> None:
    warnings.warn(f"cachedemb: the C helpers are off ({why}); every helper runs its torch code instead (the same "
                  "results, slower).", RuntimeWarning, stacklevel=5)


def _switched_off() -> bool:
    return os.environ.get("CACHEDEMB_NATIVE", "1").strip() == "0"


def disabled_helpers() -> set[str]:
    """The helpers CACHEDEMB_NATIVE_DISABLE names (comma-separated); an unknown name is an error."""
    names = {n.strip() for n in os.environ.get("CACHEDEMB_NATIVE_DISABLE", "").split(",") if n.strip()}
    unknown = sorted(names - set(NAMES))
    if unknown:
        raise ValueError(f"CACHEDEMB_NATIVE_DISABLE names unknown helpers {unknown}; expected some of {list(NAMES)}")
    return names


def native_available() -> bool:
    """Whether the C helpers run: the library is installed, loads and matches its sources, and CACHEDEMB_NATIVE
    is not 0. False means every helper runs its pure torch / numpy / Python path (the same results, slower)."""
    return library() is not None and not _switched_off()


def status() -> str:
    """A line saying whether the C helpers run, and why not."""
    if _switched_off():
        return "off: CACHEDEMB_NATIVE=0"
    lib = library()
    return f"on: {library_path()}" if lib is not None else f"off: {_state['why']}"


class Helper:
    """One helper's C functions ({name: (argtypes, restype)}), typed on first use; `get()` is the library or None
    (the caller then runs its pure path). The environment's switches are read at the first `get()`; `enabled`
    (True) switches the helper off in-process: the tests and scripts/bench_native.py compare both paths so."""

    def __init__(self, name: str, signatures: dict):
        if name not in NAMES or name in HELPERS:
            raise ValueError(f"native helper {name!r} is unknown or declared twice; expected one of {list(NAMES)}")
        self.name, self.signatures = name, signatures
        self.enabled = True
        self._lib, self._tried = None, False
        HELPERS[name] = self

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:  # two threads' first uses may both get here: both type the same functions
            lib = None if _switched_off() or self.name in disabled_helpers() else library()
            if lib is not None:
                try:
                    for fn_name, (args, result) in self.signatures.items():
                        fn = getattr(lib, fn_name)
                        fn.argtypes, fn.restype = args, result
                except AttributeError as error:
                    _warn(f"{error}: the library predates this helper's C; reinstall the package")
                    lib = None
            self._lib, self._tried = lib, True  # in this order: a thread seeing _tried sees the library
        return self._lib if self.enabled else None
