"""The docker images, checked without a docker engine: each installs a C compiler before anything needs one (the
GPU image for Triton's kernel launcher, compiled at the first launch; both for the C helpers), guards it with a
check that stops the build with a message, and copies what exists. The images' shell and Python checks are run
here as the build would run them."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cpu"]
COMPILER_PACKAGES = ("gcc", "build-essential", "clang")
# Steps that build the package, compile C or import torch/triton: a compiler must be installed before the first.
NEEDS_COMPILER = ("pip install", "setup_env.sh", "import torch", "import triton")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, as docker reads them: comment lines dropped (also inside a continued
    instruction), a trailing backslash joining the next line with the backslash and newline removed."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        full, pending = pending + line, ""
        keyword, _, args = full.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, f"{path}: the last instruction ends in a line continuation"
    return out


def runs(path: Path) -> list[str]:
    return [args for keyword, args in instructions(path) if keyword == "RUN"]


def compiler_install(cmd: str) -> bool:
    return "apt-get install" in cmd and any(re.search(rf"(^|\s){p}(\s|$)", cmd) for p in COMPILER_PACKAGES)


def compiler_guard(cmd: str) -> bool:
    return "command -v" in cmd and "exit 1" in cmd and "compiler" in cmd


@pytest.mark.parametrize("name", DOCKERFILES)
def test_compiler_installed_and_checked_before_first_use(name):
    steps = runs(ROOT / name)
    install = next((i for i, cmd in enumerate(steps) if compiler_install(cmd)), None)
    assert install is not None, f"{name}: no RUN installs a C compiler ({', '.join(COMPILER_PACKAGES)})"
    assert "--no-install-recommends" in steps[install] and "apt-get update" in steps[install], steps[install]
    guard = next((i for i, cmd in enumerate(steps) if compiler_guard(cmd)), None)
    assert guard is not None and guard > install, f"{name}: no `command -v ... || ... exit 1` check after the install"
    first_use = next((i for i, cmd in enumerate(steps) if any(s in cmd for s in NEEDS_COMPILER)), None)
    assert first_use is not None, f"{name}: no step builds the package"
    assert install < guard < first_use, (name, steps[first_use])
    build = next((cmd for cmd in steps if "pip install" in cmd or "setup_env.sh" in cmd), "")
    assert "CACHEDEMB_REQUIRE_NATIVE=1" in build and "native_available()" in build, \
        f"{name}: the package build does not require the C helpers, or the image does not check they loaded"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_structure(name):
    """FROM first, CC set to the installed compiler, every COPY source present, CMD valid exec-form JSON."""
    steps = instructions(ROOT / name)
    assert steps[0][0] == "FROM", steps[0]
    env = [args for keyword, args in steps if keyword == "ENV"]
    assert "CC=gcc" in env, env
    for keyword, args in steps:
        if keyword == "COPY":
            *sources, _dest = args.split()
            for source in sources:
                assert (ROOT / source).exists() or source == ".", f"{name}: COPY {source}: no such path"
    cmd = [args for keyword, args in steps if keyword == "CMD"]
    assert len(cmd) == 1 and isinstance(json.loads(cmd[0]), list), cmd


@pytest.mark.parametrize("name", DOCKERFILES)
def test_compiler_guard_stops_the_build_with_a_message(name):
    """Run the guard with /bin/sh (as docker's RUN does): a missing compiler exits 1 naming it, a present one 0."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no /bin/sh")
    guard = next(cmd for cmd in runs(ROOT / name) if compiler_guard(cmd))
    missing = subprocess.run([sh, "-c", guard], env={**os.environ, "CC": "no-such-cc-for-this-test"},
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1, (missing.returncode, missing.stderr)
    assert "no C compiler 'no-such-cc-for-this-test' found" in missing.stderr, missing.stderr
    present = subprocess.run([sh, "-c", guard], env={**os.environ, "CC": "sh"}, capture_output=True, text=True,
                             timeout=30)
    assert present.returncode == 0 and present.stderr == "", present.stderr


def test_gpu_image_python_checks_run():
    """The GPU image's `python -c` checks (supported torch / triton, Python.h for Triton's launcher) are valid
    Python and pass or fail as they should, run by this interpreter through /bin/sh as the build runs them."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no /bin/sh")
    checks = [cmd for cmd in runs(ROOT / "docker/Dockerfile") if cmd.startswith("python -c ")]
    assert len(checks) == 2, checks
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    import sysconfig

    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    header = Path(sysconfig.get_paths(scheme=scheme)["include"]) / "Python.h"
    for cmd in checks:
        done = subprocess.run([sh, "-c", cmd.replace("python -c ", f"{sys.executable} -c ", 1)], env=env,
                              capture_output=True, text=True, timeout=120)
        if "Python.h" in cmd and not header.is_file():
            assert done.returncode != 0 and "needs the Python headers" in done.stderr, done.stderr
        else:
            assert done.returncode == 0, (cmd, done.stderr)


def test_dockerignore_keeps_local_venv_and_data_out():
    """docker/Dockerfile.cpu copies the checkout: a local .venv's install stamp would skip the image's install."""
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".venv", "data"} <= patterns, patterns
