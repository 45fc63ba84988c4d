"""Build every C helper of the installed cachedemb now, into the per-user cache, and fail if any does not build.

The helpers are otherwise compiled on first use, and where that fails the callers quietly run their torch code
(the same results, slower). An image or CI job that means to have them runs this once, so a missing or broken
compiler stops the build with a message instead of showing up later as slow steps. Exit status: 0 when all built,
1 (naming the compiler looked for, or the files that failed) otherwise.

    python scripts/build_native.py            # prints one line per helper
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path


def sources() -> list[Path]:
    """The C files shipped inside the installed package (cachedemb/ and cachedemb.kernels, which installs from
    kernels/), each built by `cachedemb.kernels.native.load_c` on first use."""
    import cachedemb
    import cachedemb.kernels

    roots = {Path(cachedemb.__file__).parent, Path(cachedemb.kernels.__file__).parent}
    return sorted({p for root in roots for p in root.rglob("*.c")})


def main() -> int:
    if os.environ.get("CACHEDEMB_NATIVE", "1") == "0":
        print("build_native: CACHEDEMB_NATIVE=0 turns the C helpers off; unset it to build them", file=sys.stderr)
        return 1
    wanted = os.environ.get("CC", "cc")
    if (shutil.which(wanted) or shutil.which("gcc")) is None:
        print(f"build_native: no C compiler found ({wanted!r} or 'gcc' on PATH); install one (Debian/Ubuntu: "
              "apt-get install gcc libc6-dev) or set CC", file=sys.stderr)
        return 1
    from cachedemb.kernels.native import load_c

    files = sources()
    if not files:
        print("build_native: no C helpers found in the installed package", file=sys.stderr)
        return 1
    failed = []
    for source in files:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lib = load_c(source)
        if lib is None:
            failed.append(source.name)
            detail = "; ".join(str(w.message) for w in caught) or "not built"
            print(f"FAILED {source.name}: {detail}", file=sys.stderr)
        else:
            print(f"built  {source.name}")
    if failed:
        print(f"build_native: {len(failed)} of {len(files)} C helpers did not build: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    print(f"build_native: all {len(files)} C helpers built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
