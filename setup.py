"""The package build: pyproject.toml holds the metadata; this file adds the one optional C library.

`cachedemb/_native*.so` holds the C helpers (kernels/native.py loads it with ctypes; no Python C-API). Where it
does not build (no compiler) the build goes on without it, as MarkupSafe's speed-ups do, and every helper runs
its torch / numpy / Python path: `cachedemb.native_available()` says which. Switches, read at build time:

  CACHEDEMB_BUILD_NATIVE=0    build without the library (the pure install, for testing that path)
  CACHEDEMB_REQUIRE_NATIVE=1  a library that does not build fails the build (the docker images, CI)
"""
import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# Every C file of the library, and the headers they include (relative to this file).
SOURCES = [
    "cachedemb/cache/place_native.c",
    "cachedemb/cache/pool_native.c",
    "cachedemb/prefetch/host_map.c",
    "cachedemb/storage/record_copy.c",
    "cachedemb/storage/row_index.c",
    "cachedemb/storage/rowio.c",
    "cachedemb/storage/slab_victims.c",
    "kernels/host_rows.c",
    "kernels/host_sgd.c",
]
HEADERS = ["cachedemb/cache/slot_score.h"]


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class BuildFailed(Exception):
    """The C library did not build; str() is the innermost error (the compiler's own, where it ran)."""

    def __init__(self, error: BaseException):
        while error.__cause__ is not None:
            error = error.__cause__
        super().__init__(f"{type(error).__name__}: {error}")


def _digest(path: str) -> str:
    return hashlib.sha256((ROOT / path).read_bytes()).hexdigest()[:16]


class build_native(build_ext):
    """build_ext for the C library: records the sources' digests in it (kernels/native.py refuses a library
    built from other sources than a source tree beside it holds), and turns a failed build into BuildFailed."""

    def run(self):
        try:
            super().run()
        except BuildFailed:
            raise
        except Exception as error:  # no compiler (CCompilerError, PlatformError, OSError ...)
            raise BuildFailed(error) from error

    def build_extension(self, ext):
        info = Path(self.build_temp) / "cemb_build_info.c"
        info.parent.mkdir(parents=True, exist_ok=True)
        listing = ";".join(f"{p}={_digest(p)}" for p in SOURCES + HEADERS)
        text = f'const char *cemb_build_sources(void) {{ return "{listing}"; }}\n'
        if not info.is_file() or info.read_text() != text:  # unchanged: the up-to-date check may skip the build
            info.write_text(text)
        ext.sources = [s for s in ext.sources if not s.endswith("cemb_build_info.c")] + [str(info)]
        try:
            super().build_extension(ext)
        except Exception as error:
            raise BuildFailed(error) from error


def run_setup(native: bool) -> None:
    ext = Extension("cachedemb._native", sources=list(SOURCES), depends=list(HEADERS),
                    extra_compile_args=["-O2"], py_limited_api=False)
    setup(ext_modules=[ext] if native else [], cmdclass={"build_ext": build_native})


if os.environ.get("CACHEDEMB_BUILD_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
    print("cachedemb: CACHEDEMB_BUILD_NATIVE=0: building without the C helpers (pure paths)", file=sys.stderr)
    run_setup(False)
elif sys.platform == "win32":
    if _flag("CACHEDEMB_REQUIRE_NATIVE"):
        raise SystemExit("cachedemb: CACHEDEMB_REQUIRE_NATIVE=1, but the C helpers are built on Linux/macOS only")
    run_setup(False)
else:
    try:
        run_setup(True)
    except BuildFailed as error:
        if _flag("CACHEDEMB_REQUIRE_NATIVE"):
            raise SystemExit(f"cachedemb: the C helpers did not build ({error}) and "
                             "CACHEDEMB_REQUIRE_NATIVE=1 asks for them") from error
        print("=" * 78 + f"\nWARNING: cachedemb's C helpers did not build:\n  {error}\n"
              "cachedemb installs without them: every helper runs its torch/numpy path (the same results,\n"
              "slower); cachedemb.native_available() is False. Install a C compiler and reinstall for them.\n"
              + "=" * 78, file=sys.stderr)
        run_setup(False)
