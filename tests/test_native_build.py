"""Every C helper the package ships builds where a compiler is at hand.

A C file that stops compiling is not an error at run time: its callers fall back to their torch (or Python)
code, which gives the same results, only slower, and the tests of the C path skip as they do on a machine
without a compiler. This is the test that notices.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

import cachedemb
from cachedemb.kernels import native

ROOTS = [Path(cachedemb.__file__).parent, Path(native.__file__).parent]
SOURCES = sorted({p.resolve() for root in ROOTS for p in root.rglob("*.c")})


def test_the_package_ships_its_c_helpers():
    names = {p.name for p in SOURCES}
    assert {"host_rows.c", "host_sgd.c", "host_sort.c", "place_native.c", "record_copy.c", "rowio.c"} <= names


@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_c_helper_builds_and_loads(source, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    # The compiler's own word first (an error names the line), then the library's loader, as the callers load it.
    built = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp_path / "lib.so"),
                            str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert native.load_c(source) is not None


def test_a_helper_that_does_not_build_warns_and_its_callers_fall_back(tmp_path, monkeypatch):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    broken = tmp_path / "broken_helper.c"
    broken.write_text("int cemb_broken(void) { return undeclared_name; }\n")
    with pytest.warns(RuntimeWarning, match=r"broken_helper\.c did not build.*undeclared_name"):
        assert native.load_c(broken) is None
    assert native.load_c(broken) is None  # answered from the first try: no second build, no second warning
    fine = tmp_path / "fine_helper.c"
    fine.write_text("int cemb_fine(void) { return 7; }\n")
    assert native.load_c(fine).cemb_fine() == 7
