"""The C helpers' contract (kernels/native.py, setup.py): one library, built by the package build, found in the
package directory only, never compiled or cached at run time; a build without a compiler (or with
CACHEDEMB_BUILD_NATIVE=0) installs a working pure package, and CACHEDEMB_REQUIRE_NATIVE=1 turns that into an
error. The helpers' results are compared with their pure paths in their own tests (test_place_native.py, ...).
"""
import ast
import importlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cachedemb
from cachedemb.kernels import native

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(cachedemb.__file__).parent
MODULES = ["cachedemb.cache.place_native", "cachedemb.cache.pool_native", "cachedemb.prefetch.host_map",
           "cachedemb.storage.record_copy", "cachedemb.storage.row_index", "cachedemb.storage.rowio",
           "cachedemb.storage.slab_victims", "cachedemb.kernels.host_rows", "cachedemb.kernels.host_sgd"]
needs_library = pytest.mark.skipif(native.library() is None, reason=f"C helpers not built ({native.status()})")
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


def setup_sources() -> list[str]:
    """setup.py's SOURCES + HEADERS, read from the file (it runs setup() when imported)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    values = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id in ("SOURCES", "HEADERS")}
    return values["SOURCES"] + values["HEADERS"]


def run_python(code: str, env: dict, cwd=None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CACHEDEMB_")} | env
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_every_c_file_of_the_tree_is_in_the_library_and_every_helper_is_declared():
    tree = sorted(str(p.relative_to(ROOT)) for d in ("cachedemb", "kernels") for p in (ROOT / d).rglob("*.[ch]"))
    assert sorted(setup_sources()) == tree
    for name in MODULES:
        importlib.import_module(name)
    assert sorted(native.HELPERS) == sorted(native.NAMES)
    with pytest.raises(ValueError, match="'nope'"):
        native.Helper("nope", {})


@needs_library
def test_the_library_is_the_package_dirs_for_this_interpreter_and_matches_its_sources():
    path = native.library_path()
    assert path.parent == PKG and path.name.startswith("_native")
    assert any(path.name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)
    assert native.native_available() == (os.environ.get("CACHEDEMB_NATIVE") != "0")
    if native.native_available():
        assert all(h.get() is not None for h in native.HELPERS.values())
    listed = native.library().cemb_build_sources().decode().split(";")
    assert sorted(entry.partition("=")[0] for entry in listed) == sorted(setup_sources())


@needs_library
def test_a_library_built_from_other_sources_is_refused(tmp_path):
    """An editable install whose C (a header too) changed since its build: the library is not loaded."""
    lib = native.library()
    (tmp_path / "setup.py").write_text("")
    for rel in setup_sources():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert native._stale(lib, tmp_path / "cachedemb") is None
    header = tmp_path / "cachedemb/cache/slot_score.h"
    header.write_text(header.read_text() + "\n")
    assert native._stale(lib, tmp_path / "cachedemb") == "cachedemb/cache/slot_score.h"
    (tmp_path / "setup.py").unlink()  # an installed wheel: no source tree beside the package, nothing to check
    assert native._stale(lib, tmp_path / "cachedemb") is None


STEP = """
import json, torch, cachedemb
from cachedemb.kernels import native, host_rows
emb = cachedemb.CachedEmbeddingBag(5000, 8, mode="sum", cache_rows=300, optimizer=cachedemb.optim.SGD(lr=0.1),
                                   device="cpu")
g = torch.Generator().manual_seed(0)
for _ in range(3):
    ids = torch.randint(0, 5000, (2000,), generator=g)
    emb(ids, torch.arange(0, 2000, 20)).sum().backward()
src, dst = torch.randn(100, 8, generator=g), torch.zeros(50, 8)
s_idx, d_idx = torch.randperm(100, generator=g)[:40], torch.randperm(50, generator=g)[:40]
want = dst.clone()
want[d_idx] = src[s_idx]
if not host_rows.copy_rows(src, s_idx, dst, d_idx, 40):  # False: the caller's torch copy (the pure path)
    dst[d_idx] = src[s_idx]
ok = torch.equal(dst, want)
print(json.dumps(dict(available=cachedemb.native_available(), status=native.status(), sort_ok=ok,
                      on=sorted(n for n, h in native.HELPERS.items() if h.get() is not None), pkg=cachedemb.__file__)))
"""


def test_run_time_compiles_nothing_and_writes_no_cache(tmp_path):
    """A training step with no compiler on PATH and an empty home: the helpers run (where built), nothing is
    written under the home's cache."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PATH": str(tmp_path / "no-bin"),
           "CC": str(tmp_path / "no-cc")}
    run = run_python(STEP, env)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["available"] == (native.library() is not None) and got["sort_ok"]
    assert not (home / ".cache" / "cachedemb").exists()
    assert got["on"] == (sorted(native.NAMES) if got["available"] else [])


def test_the_run_time_switches(monkeypatch):
    """CACHEDEMB_NATIVE=0 turns every helper off, CACHEDEMB_NATIVE_DISABLE the ones it names (an unknown name is
    an error naming it); each helper reads them at its first use (here made first again)."""
    for name in MODULES:
        importlib.import_module(name)

    def first_use(**env):
        for key in ("CACHEDEMB_NATIVE", "CACHEDEMB_NATIVE_DISABLE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for h in native.HELPERS.values():
            monkeypatch.setattr(h, "_tried", False)
            monkeypatch.setattr(h, "_lib", h._lib)  # restored after the test, as _tried
        return sorted(n for n, h in native.HELPERS.items() if h.get() is not None)

    assert first_use(CACHEDEMB_NATIVE="0") == []
    assert not native.native_available() and native.status() == "off: CACHEDEMB_NATIVE=0"
    if native.library() is not None:
        on = first_use(CACHEDEMB_NATIVE_DISABLE="host_rows, rowio")
        assert on == sorted(set(native.NAMES) - {"host_rows", "rowio"})
        assert native.native_available() and native.status().startswith("on: ")
    with pytest.raises(ValueError, match=r"unknown helpers \['hostrows'\]"):
        first_use(CACHEDEMB_NATIVE_DISABLE="host_rows,hostrows")


def source_copy(tmp_path: Path) -> Path:
    """The files a build reads, without the built library."""
    src = tmp_path / "src"
    for name in ("setup.py", "pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for folder in ("cachedemb", "kernels", "recipes"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "_native*"))
    return src


def _setuptools_version() -> tuple:
    import setuptools

    return tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())


# These build the package with this interpreter's setuptools (no build isolation): pyproject's PEP 639 license
# string needs setuptools >= 77 (pip's isolated builds fetch a newer one; a bare fresh venv may carry an older one).
needs_setuptools_77 = pytest.mark.skipif(_setuptools_version() < (77,),
                                         reason="building here needs setuptools >= 77 (pyproject's license string)")


def build_wheel(src: Path, out: Path, env: dict) -> tuple[subprocess.CompletedProcess, list[Path]]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CACHEDEMB_")} | env
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(out), f"{src}{os.sep}"], env=full, capture_output=True, text=True, timeout=600)
    return run, sorted(out.glob("*.whl"))


@needs_setuptools_77
def test_a_pure_build_installs_a_working_package(tmp_path):
    """CACHEDEMB_BUILD_NATIVE=0: a py3-none-any wheel without the library or C sources, whose package runs
    every helper's pure path (native_available() False, the results right)."""
    run, wheels = build_wheel(source_copy(tmp_path), tmp_path / "out", {"CACHEDEMB_BUILD_NATIVE": "0"})
    assert run.returncode == 0, run.stderr
    assert [w.name for w in wheels] == ["cachedemb-0.1.0-py3-none-any.whl"]
    site = tmp_path / "site"
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
        whl.extractall(site)
    assert not [n for n in names if n.endswith((".so", ".c", ".h"))]
    got = run_python(STEP, {"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    got = json.loads(got.stdout.splitlines()[-1])
    assert Path(got["pkg"]).is_relative_to(site)
    assert not got["available"] and got["on"] == [] and got["sort_ok"]
    assert got["status"].startswith("off: not built")


@pytest.mark.slow  # a full wheel build (the editable install of the fast suite builds the library too)
@needs_cc
@needs_setuptools_77
def test_a_built_wheel_carries_the_library_not_the_sources(tmp_path):
    run, wheels = build_wheel(source_copy(tmp_path), tmp_path / "out", {"CACHEDEMB_REQUIRE_NATIVE": "1"})
    assert run.returncode == 0, run.stderr
    assert len(wheels) == 1 and "-none-any" not in wheels[0].name
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
    libs = [n for n in names if n.endswith(".so")]
    assert len(libs) == 1 and libs[0].startswith("cachedemb/_native")
    assert any(libs[0].endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)
    assert not [n for n in names if n.endswith((".c", ".h"))]


@needs_setuptools_77
def test_without_a_compiler_the_build_warns_and_goes_on_unless_the_library_is_required(tmp_path):
    src = source_copy(tmp_path)
    no_cc = {"CC": str(tmp_path / "no-such-cc")}
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEDEMB_")} | no_cc
    run = subprocess.run(build, cwd=src, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "cachedemb's C helpers did not build" in run.stderr and "no-such-cc" in run.stderr
    assert not list((src / "cachedemb").glob("_native*"))
    run = subprocess.run(build, cwd=src, env=env | {"CACHEDEMB_REQUIRE_NATIVE": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "CACHEDEMB_REQUIRE_NATIVE=1" in run.stderr
