#!/usr/bin/env python
"""Run the peers' own test suites against cachedemb's modules and print JSON.

Two suites, each run twice, once stock and once with our module swapped in:

* ``pytorch``: every test in PyTorch's ``test/nn/test_embedding.py`` whose name mentions EmbeddingBag /
  embedding_bag (the ``TestEmbeddingNN`` class and the CPU instantiation of ``TestEmbeddingNNDeviceType``),
  plus the EmbeddingBag module tests that PyTorch's ``test/test_nn.py`` generates from
  ``torch.testing._internal.common_nn`` (``module_tests`` + ``get_new_module_tests()`` entries whose
  ``module_name`` is 'EmbeddingBag' or whose ``fullname`` starts with 'EmbeddingBag_', run through
  ``NewModuleTest`` the way test_nn.py does; that file is not needed, the generation is re-done here).
  "ours" replaces ``torch.nn.EmbeddingBag``, ``torch.nn.modules.EmbeddingBag``,
  ``torch.nn.modules.sparse.EmbeddingBag`` and any test-module global bound to the stock class by a
  subclass of ``cachedemb.CachedEmbeddingBag`` that passes every argument through and adds
  ``cache_rows=max(1, num_embeddings // 4)``; its ``from_pretrained`` is a classmethod forwarding to
  ``CachedEmbeddingBag.from_pretrained`` with the same cache size. ``torch.nn.functional.embedding_bag``
  is not touched, so tests that only call the functional pass in both runs: the JSON marks them with
  ``"exercises_module": false`` (no swapped-in module was built during the test).
* ``torchrec``: torchrec's ``torchrec/modules/tests/test_embedding_modules.py`` and
  ``torchrec/models/tests/test_dlrm.py``. "ours" replaces ``EmbeddingBagCollection`` in every loaded
  ``torchrec.*`` module that holds it (``torchrec.modules.embedding_modules``, ``torchrec``,
  ``torchrec.models.dlrm``, ...) and in the test modules' globals by a thin subclass of
  ``cachedemb.CachedEmbeddingBagCollection`` taking torchrec's arguments (``tables`` = the torchrec
  ``EmbeddingBagConfig`` list, passed through unchanged; ``is_weighted``; ``device``) plus
  ``cache_ratio=0.25``. No config conversion: gaps in the collection show up as failures.

Each (suite, variant) runs in its own worker subprocess (so the patches never reach the stock run) with
unittest's loader and a result object that records every test's outcome, the first line of its error and
the innermost frame in cachedemb/ or kernels/ (``where``). A test that kills or hangs its worker is
recorded as ``crashed``/``timeout`` and the worker is restarted after it. The files are unittest-based
(torch's ``TestCase`` / ``unittest.TestCase``), so unittest runs them as their own ``run_tests()`` would.

Usage::

    python scripts/peer_suites.py --suite pytorch|torchrec|all [--backend torch|triton] [--sync-free]
                                  [--out FILE [--merge]] [--pytorch-test-file PATH] [--torchrec-dir DIR]
                                  [--code-at REV] [-k SUBSTRING] [--variants stock,ours] [--test-timeout S]

``--backend`` sets ``CACHEDEMB_BACKEND`` (``triton`` also sets ``TRITON_INTERPRET=1``), ``--sync-free``
sets ``CACHEDEMB_SYNC_FREE=1`` (kernels/dispatch.py, cachedemb/cache/sync_mode.py). ``--out FILE`` writes the
JSON there too; with ``--merge`` the file holds ``{"runs": [...]}`` and this run replaces the one with the
same (suite, backend, sync_free). ``--code-at REV`` tests ``cachedemb/`` + ``kernels/`` as committed at REV
(``git archive`` into a temp dir put first on PYTHONPATH) rather than the work tree, which colleagues may be
editing; without it the JSON lists the uncommitted files under test. Exit status 0 unless the harness
itself failed (test failures are data).

Getting the third-party test files (they are NOT in this repo and must never be committed)
-----------------------------------------------------------------------------------------
* PyTorch: ``test/nn/test_embedding.py`` from the pytorch/pytorch repository, saved byte-exactly to
  ``/work/peer/pytorch/test/nn/test_embedding.py`` (or pass ``--pytorch-test-file``). The committed results
  used the file at pytorch commit 013a59d6d3b4d2ac367f0ef146c61568ca9f8f2d (63,768 bytes, sha256 2b827a18...;
  the JSON names the sha256 of the file each run used)::

      base=https://raw.githubusercontent.com/pytorch/pytorch/013a59d6d3b4d2ac367f0ef146c61568ca9f8f2d
      mkdir -p /work/peer/pytorch/test/nn && curl -fsSL "$base/test/nn/test_embedding.py" \\
          -o /work/peer/pytorch/test/nn/test_embedding.py

  It imports ``torch.testing._internal.*``, which ships with torch but needs ``pip install expecttest``.
* torchrec: from a torchrec git checkout whose tests match the installed torchrec (1.8: tag
  ``v1.8.0-rc1``; these two files are identical at that tag and at main as of 2026-08)::

      mkdir -p /work/peer/torchrec/torchrec/{modules,models}/tests
      git -C TORCHREC show v1.8.0-rc1:torchrec/modules/tests/test_embedding_modules.py \\
          > /work/peer/torchrec/torchrec/modules/tests/test_embedding_modules.py
      git -C TORCHREC show v1.8.0-rc1:torchrec/models/tests/test_dlrm.py \\
          > /work/peer/torchrec/torchrec/models/tests/test_dlrm.py
      # the torchrec 1.8.0 wheel lacks torchrec/ir, which test_dlrm imports: take it from the same tag
      mkdir -p /work/peer/torchrec/overlay && git -C TORCHREC archive v1.8.0-rc1 torchrec/ir \\
          | tar -x -C /work/peer/torchrec/overlay

  The harness appends ``<torchrec-dir>/overlay/torchrec`` to ``torchrec.__path__`` only when the installed
  package has no ``torchrec.ir``. test_dlrm also needs ``pip install parameterized`` (a test-only
  dependency, not in requirements-cpu.txt).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PYTORCH_TEST_FILE = Path("/work/peer/pytorch/test/nn/test_embedding.py")
DEFAULT_TORCHREC_DIR = Path("/work/peer/torchrec")
TORCHREC_TEST_FILES = ("torchrec/modules/tests/test_embedding_modules.py", "torchrec/models/tests/test_dlrm.py")
PYTORCH_NAME_RE = re.compile(r"embedding_?bag", re.IGNORECASE)
TORCHREC_CACHE_RATIO = 0.25
MACHINE = "CPU-only dev box, 2 cores"


def cache_rows_for(num_embeddings: int) -> int:
    """The cache size of the swapped-in CachedEmbeddingBag: a quarter of the rows, at least one."""
    return max(1, int(num_embeddings) // 4)


# ====================================================================================== worker side
class _Counter:
    """How many swapped-in modules the running test built (0 = the test never exercised ours)."""
    built = 0


def _install_pytorch_patch():
    import torch
    import torch.nn.modules
    import torch.nn.modules.sparse

    from cachedemb import CachedEmbeddingBag

    stock = torch.nn.modules.sparse.EmbeddingBag

    class EmbeddingBag(CachedEmbeddingBag):
        """nn.EmbeddingBag's signature; builds a CachedEmbeddingBag caching a quarter of the rows."""

        def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
            kwargs.setdefault("cache_rows", cache_rows_for(num_embeddings))
            _Counter.built += 1
            super().__init__(num_embeddings, embedding_dim, *args, **kwargs)

        @classmethod
        def from_pretrained(cls, embeddings, *args, **kwargs):
            rows = embeddings.shape[0] if embeddings.dim() else 0
            kwargs.setdefault("cache_rows", cache_rows_for(rows))
            _Counter.built += 1
            return CachedEmbeddingBag.from_pretrained(embeddings, *args, **kwargs)

    _make_importable(EmbeddingBag, "_SwappedEmbeddingBag")
    for mod in (torch.nn, torch.nn.modules, torch.nn.modules.sparse):
        mod.EmbeddingBag = EmbeddingBag
    return stock, EmbeddingBag


def _make_importable(cls, qualname: str) -> None:
    """Pickle (torch.save, deepcopy in the peers' tests) finds classes by module + qualname: bind the swap
    class (defined inside a function so that a stock run never imports cachedemb) at this module's top level."""
    cls.__qualname__ = qualname
    cls.__module__ = __name__
    globals()[qualname] = cls


def _patch_globals(module, stock, replacement) -> list[str]:
    names = [k for k, v in vars(module).items() if v is stock]
    for k in names:
        setattr(module, k, replacement)
    return names


def _install_torchrec_patch():
    import torchrec  # noqa: F401  (load the importers before sweeping sys.modules)
    import torchrec.models.dlrm  # noqa: F401
    import torchrec.modules.embedding_modules as em

    from cachedemb import CachedEmbeddingBagCollection

    stock = em.EmbeddingBagCollection

    class EmbeddingBagCollection(CachedEmbeddingBagCollection):
        """torchrec's EmbeddingBagCollection(tables, is_weighted, device), built as a cachedemb collection
        with cache_ratio=0.25. The torchrec EmbeddingBagConfig list is passed through unchanged."""

        def __init__(self, tables, is_weighted: bool = False, device=None):
            _Counter.built += 1
            super().__init__(tables, is_weighted=is_weighted, device=device, cache_ratio=TORCHREC_CACHE_RATIO)

    _make_importable(EmbeddingBagCollection, "_SwappedEmbeddingBagCollection")
    patched = []
    for name, mod in list(sys.modules.items()):
        if (name == "torchrec" or name.startswith("torchrec.")) and mod is not None:
            if _patch_globals(mod, stock, EmbeddingBagCollection):
                patched.append(name)
    return stock, EmbeddingBagCollection, patched


def _ensure_torchrec_ir(torchrec_dir: Path) -> str:
    """test_dlrm imports torchrec.ir, which the torchrec 1.8.0 wheel does not ship."""
    import torchrec
    if importlib.util.find_spec("torchrec.ir") is not None:
        return "installed"
    overlay = torchrec_dir / "overlay" / "torchrec"
    if (overlay / "ir").is_dir():
        torchrec.__path__.append(str(overlay))
        return f"overlay {overlay / 'ir'}"
    return "missing"


def _load_file_as_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _module_tests_case(torch_nn):
    """test_nn.py's TestNN, reduced to what NewModuleTest calls, with the EmbeddingBag module tests added the
    way test_nn.py's `for test_params in module_tests + get_new_module_tests()` loop adds them."""
    import copy

    import torch
    from torch.testing._internal import common_nn
    from torch.testing._internal.common_nn import NewModuleTest, NNTestCase
    from torch.testing._internal.common_utils import freeze_rng_state

    class TestNN(NNTestCase):
        _do_cuda_memory_leak_check = True
        _do_cuda_non_default_stream = True

        def _forward(self, module, input):
            with freeze_rng_state():
                if isinstance(input, tuple):
                    return module(*input)
                return module(input)

        def _backward(self, module, input, output, grad_output, create_graph=False):
            output.backward(grad_output, retain_graph=True, create_graph=create_graph)
            if isinstance(input, tuple):
                return tuple(i.grad.data if i.grad is not None else None for i in input)
            return input.grad.data if input.grad is not None else None

        def _zero_grad_parameters(self, module):
            for p in module.parameters():
                if p.grad is not None:
                    with torch.no_grad():
                        p.grad.zero_()
                    p.grad.detach_()

        def _get_parameters(self, module):
            params, d_params = [], []
            for p in module.parameters():
                params.append(p)
                d_params.append(p.grad)
            return params, d_params

    def add_test(test, decorator=None):
        def add(test_name, fn):
            if hasattr(TestNN, test_name):
                raise RuntimeError("Found two tests with the same name: " + test_name)
            if decorator is not None:
                fn = decorator(fn)
            setattr(TestNN, test_name, fn)

        if not hasattr(test, "test_cpu") or test.test_cpu:
            add(test.get_name(), lambda self, test=test: test(self))
        # test_nn.py also adds a `_cuda` twin; CPU-only here.

    new_tests = common_nn.get_new_module_tests() if hasattr(common_nn, "get_new_module_tests") \
        else common_nn.new_module_tests
    for test_params in list(common_nn.module_tests) + list(new_tests):
        is_bag = test_params.get("module_name") == "EmbeddingBag" or \
            str(test_params.get("fullname", "")).startswith("EmbeddingBag_")
        if not is_bag:
            continue
        test_params = copy.copy(test_params)
        if "constructor" not in test_params:
            name = test_params.pop("module_name")
            test_params["constructor"] = getattr(torch_nn, name)
        decorator = test_params.pop("decorator", None)
        add_test(NewModuleTest(**test_params), decorator)
        if "check_eval" in test_params:
            desc = test_params.get("desc", None)
            test_params["desc"] = "eval" if desc is None else desc + "_eval"

            def gen_eval_constructor(constructor):
                def eval_constructor(*args, **kwargs):
                    cons = constructor(*args, **kwargs)
                    cons.training = False
                    return cons
                eval_constructor.__name__ = constructor.__name__
                return eval_constructor

            test_params["constructor"] = gen_eval_constructor(test_params["constructor"])
            add_test(NewModuleTest(**test_params), decorator)
        if "check_with_long_tensor" in test_params:
            raise RuntimeError("check_with_long_tensor EmbeddingBag entries are not generated by this harness")
    return TestNN


def _iter_tests(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _iter_tests(t)
        else:
            yield t


def _collect(args) -> list[tuple[str, unittest.TestCase]]:
    loader = unittest.TestLoader()
    tests: list[tuple[str, unittest.TestCase]] = []
    if args.suite == "pytorch":
        import torch.nn
        mod = _load_file_as_module(Path(args.pytorch_test_file), "test_embedding")
        if args._variant == "ours":
            _patch_globals(mod, args._stock, args._ours)
        for cls_name in ("TestEmbeddingNN", "TestEmbeddingNNDeviceTypeCPU"):
            cls = getattr(mod, cls_name, None)
            if cls is None:
                raise RuntimeError(f"{args.pytorch_test_file} has no class {cls_name}")
            for t in _iter_tests(loader.loadTestsFromTestCase(cls)):
                if PYTORCH_NAME_RE.search(t._testMethodName):
                    tests.append((f"{cls_name}.{t._testMethodName}", t))
        for t in _iter_tests(loader.loadTestsFromTestCase(_module_tests_case(torch.nn))):
            tests.append((f"test_nn.TestNN.{t._testMethodName}", t))
    else:
        for rel in TORCHREC_TEST_FILES:
            path = Path(args.torchrec_dir) / rel
            name = Path(rel).stem
            mod = _load_file_as_module(path, name)
            if args._variant == "ours":
                _patch_globals(mod, args._stock, args._ours)
            for t in _iter_tests(loader.loadTestsFromModule(mod)):
                tests.append((f"{name}.{type(t).__name__}.{t._testMethodName}", t))
    return tests


def _first_line(exc: BaseException) -> str:
    """`Type: first non-empty line of the message` (TorchScript messages start with a newline)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    first = lines[0].split("\\n")[0]  # KeyError's str() is a repr: newlines appear as a literal \n
    return f"{type(exc).__name__}: {first}"[:500]


def _where(tb) -> str | None:
    """Innermost frame in this repo's cachedemb/ or kernels/, else the innermost frame in a test file."""
    root = os.environ.get("PEER_SUITES_CODE_ROOT", str(REPO))
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if f.filename.startswith(root)
            and any(f"{os.sep}{d}{os.sep}" in f.filename for d in ("cachedemb", "kernels"))]
    pick = ours[-1] if ours else next((f for f in reversed(frames) if "/test_" in f.filename), None)
    if pick is None:
        return None
    name = os.path.relpath(pick.filename, root) if pick.filename.startswith(root) else Path(pick.filename).name
    return f"{name}:{pick.lineno} ({pick.name})"


class _Result(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcome, self.error, self.where = "passed", None, None

    def _set(self, outcome, err):
        if self.outcome in ("error", "failed"):
            return  # keep the first problem (later ones are often consequences, e.g. tearDown)
        self.outcome = outcome
        if err is not None:
            self.error, self.where = _first_line(err[1]), _where(err[2])

    def addError(self, test, err):
        self._set("error", err)

    def addFailure(self, test, err):
        self._set("failed", err)

    def addSkip(self, test, reason):
        self.outcome, self.error = "skipped", str(reason).splitlines()[0] if reason else None

    def addExpectedFailure(self, test, err):
        self.outcome = "xfail"

    def addUnexpectedSuccess(self, test):
        self.outcome = "xpass"

    def addSubTest(self, test, subtest, err):
        if err is not None:
            is_fail = issubclass(err[0], test.failureException)
            self._set("failed" if is_fail else "error", err)


class _TestTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _TestTimeout("test ran past --test-timeout")


def worker_main(args) -> int:
    sys.argv = [sys.argv[0]]  # torch.testing._internal.common_utils parses sys.argv at import
    done = set(json.loads(Path(args._skip).read_text())) if args._skip else set()
    torchrec_ir = _ensure_torchrec_ir(Path(args.torchrec_dir)) if args.suite == "torchrec" else None
    args._stock = args._ours = None
    patched = []
    if args._variant == "ours":
        if args.suite == "pytorch":
            args._stock, args._ours = _install_pytorch_patch()
        else:
            args._stock, args._ours, _ = _install_torchrec_patch()
    out = open(args._results, "a", buffering=1)
    try:
        tests = _collect(args)
    except Exception as e:  # noqa: BLE001 - report collection failures as data
        out.write(json.dumps({"event": "collect_error", "error": _first_line(e),
                              "traceback": traceback.format_exc()[-4000:]}) + "\n")
        return 3
    if args.k:
        tests = [(i, t) for i, t in tests if args.k in i]
    if args._variant == "ours":
        # Where the swap is in effect after the test modules were imported, and where the stock class is still
        # bound under a module-level name (torch's own torch.nn.modules.* internals aside).
        bound, stale = [], []
        prefix = "torch" if args.suite == "pytorch" else "torchrec"
        for name, m in list(sys.modules.items()):
            values = list(getattr(m, "__dict__", {}).values())
            if any(v is args._ours for v in values):
                bound.append(name)
            if any(v is args._stock for v in values) and (name.startswith("test_") or name == prefix
                                                          or name.startswith(prefix + ".")):
                stale.append(name)
        patched = {"bound_to_ours": sorted(set(bound) - {__name__, "__main__", "__mp_main__"}),
                   "still_stock": sorted(stale)}
    if not done:
        imported = sys.modules.get("cachedemb")
        out.write(json.dumps({"event": "collected", "ids": [i for i, _ in tests],
                              "cachedemb_file": getattr(imported, "__file__", None),
                              "patched": patched, "torchrec_ir": torchrec_ir}) + "\n")
    signal.signal(signal.SIGALRM, _on_alarm)
    for test_id, test in tests:
        if test_id in done:
            continue
        out.write(json.dumps({"event": "start", "id": test_id}) + "\n")
        result = _Result()
        _Counter.built = 0
        t0 = time.perf_counter()
        signal.alarm(int(args.test_timeout))
        try:
            test.run(result)
        except _TestTimeout as e:  # raised outside the test's own try (setUp/tearDown machinery)
            result._set("timeout", (type(e), e, e.__traceback__))
        finally:
            signal.alarm(0)
        if result.error and result.error.startswith("_TestTimeout"):
            result.outcome = "timeout"
        out.write(json.dumps({"event": "end", "id": test_id, "outcome": result.outcome, "error": result.error,
                              "where": result.where, "seconds": round(time.perf_counter() - t0, 3),
                              "built": _Counter.built}) + "\n")
    if args._variant == "ours":
        from kernels import dispatch
        import torch
        out.write(json.dumps({"event": "backend", "resolved_for_cpu": dispatch.backend_for(torch.device("cpu")),
                              "triton_imported": "triton" in sys.modules,
                              "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}) + "\n")
    out.close()
    return 0


# ====================================================================================== parent side
def _run_variant(args, suite: str, variant: str, env: dict, tmp: Path) -> dict:
    results = tmp / f"{suite}-{variant}.jsonl"
    skip = tmp / f"{suite}-{variant}-skip.json"
    results.write_text("")
    outcomes: dict[str, dict] = {}
    collected: list[str] | None = None
    collect_error = imported_from = patched = backend = torchrec_ir = None
    restarts = 0
    while True:
        skip.write_text(json.dumps(sorted(outcomes)))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", "--suite", suite, "--_variant", variant,
               "--_results", str(results), "--_skip", str(skip), "--pytorch-test-file", str(args.pytorch_test_file),
               "--torchrec-dir", str(args.torchrec_dir), "--test-timeout", str(args.test_timeout)]
        if args.k:
            cmd += ["-k", args.k]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=args.worker_timeout, text=True, errors="replace")
            rc, tail = proc.returncode, proc.stdout[-2000:]
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, tail = "worker_timeout", out[-2000:]
        started = None
        for line in results.read_text().splitlines():
            ev = json.loads(line)
            if ev["event"] == "collected":
                collected, imported_from, patched = ev["ids"], ev.get("cachedemb_file"), ev.get("patched")
                torchrec_ir = ev.get("torchrec_ir")
            elif ev["event"] == "backend":
                backend = {k: v for k, v in ev.items() if k != "event"}
            elif ev["event"] == "collect_error":
                collect_error = ev
            elif ev["event"] == "start":
                started = ev["id"]
            elif ev["event"] == "end":
                outcomes[ev["id"]] = {k: ev[k] for k in ("outcome", "error", "where", "seconds", "built")}
                started = None
        if collect_error is not None or collected is None:
            return {"collect_error": collect_error or {"error": f"worker exited {rc}", "output": tail}}
        if started is not None and started not in outcomes:
            outcomes[started] = {"outcome": "timeout" if rc == "worker_timeout" else "crashed",
                                 "error": f"worker {'timed out' if rc == 'worker_timeout' else f'exited {rc}'}: "
                                          + (tail.strip().splitlines() or [""])[-1][:300],
                                 "where": None, "seconds": round(time.perf_counter() - t0, 3), "built": None}
        if all(i in outcomes for i in collected) or restarts > len(collected):
            break
        restarts += 1
    code_root = env.get("PEER_SUITES_CODE_ROOT", "")
    if variant == "ours" and not str(imported_from).startswith(code_root):
        raise SystemExit(f"{suite}/{variant}: cachedemb came from {imported_from}, not from {code_root}")
    return {"collected": collected, "outcomes": outcomes, "worker_restarts": restarts,
            "cachedemb_file": imported_from, "patched": patched, "backend": backend, "torchrec_ir": torchrec_ir}


def _normalize(msg: str | None) -> str:
    if not msg:
        return "(no message)"
    msg = re.sub(r"0x[0-9a-f]+", "0x_", msg)
    msg = re.sub(r"\btorch\.(float|bfloat|int)\d+\b|\btorch\.(half|double|long|int)\b", "<dtype>", msg)
    msg = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", msg)
    return msg[:200]


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def run_suite(args, suite: str, env: dict, tmp: Path) -> dict:
    t0 = time.perf_counter()
    variants = {v: _run_variant(args, suite, v, env, tmp) for v in args.variants}
    out: dict = {"seconds": None}
    if suite == "pytorch":
        out["sources"] = {"test_embedding.py": {"path": str(args.pytorch_test_file),
                                                "sha256": _sha256(Path(args.pytorch_test_file))},
                          "module_tests": "torch.testing._internal.common_nn (installed torch), generated as "
                                          "test/test_nn.py does"}
        out["swap"] = ("torch.nn.EmbeddingBag -> subclass of cachedemb.CachedEmbeddingBag, "
                       "cache_rows=max(1, num_embeddings // 4); from_pretrained forwards with the same cache size")
    else:
        out["sources"] = {rel: {"path": str(Path(args.torchrec_dir) / rel),
                                "sha256": _sha256(Path(args.torchrec_dir) / rel)} for rel in TORCHREC_TEST_FILES}
        out["swap"] = ("torchrec EmbeddingBagCollection -> subclass of cachedemb.CachedEmbeddingBagCollection "
                       "(tables passed through unchanged, is_weighted, device, cache_ratio=0.25)")
    errors = {v: r["collect_error"] for v, r in variants.items() if "collect_error" in r}
    if errors:
        out["collect_errors"] = errors
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out
    ids = next(iter(variants.values()))["collected"]
    for v, r in variants.items():
        if r["collected"] != ids:
            out.setdefault("warnings", []).append(f"{v} collected a different test list ({len(r['collected'])})")
    tests = {}
    for i in ids:
        row = {}
        for v, r in variants.items():
            o = r["outcomes"].get(i, {"outcome": "missing"})
            row[v] = o["outcome"]
            if o["outcome"] not in ("passed", "xfail"):
                row[f"{v}_error"] = o.get("error")
                if v == "ours" and o.get("where"):
                    row["ours_where"] = o["where"]
            row[f"{v}_seconds"] = o.get("seconds")
        if "ours" in variants:
            built = variants["ours"]["outcomes"].get(i, {}).get("built")
            row["exercises_module"] = None if built is None else built > 0
        tests[i] = row
    counts = {"total": len(ids)}
    for v in variants:
        for outcome in ("passed", "failed", "error", "skipped", "crashed", "timeout", "xfail", "xpass"):
            n = sum(1 for t in tests.values() if t[v] == outcome)
            if n or outcome in ("passed", "failed", "error", "skipped"):
                counts[f"{outcome}_{v}"] = n
    if "ours" in variants and "stock" in variants:
        counts["passed_stock_failed_ours"] = sum(1 for t in tests.values()
                                                 if t["stock"] == "passed" and t["ours"] != "passed")
        ex = [t for t in tests.values() if t.get("exercises_module")]
        counts["exercising_module"] = len(ex)
        counts["exercising_module_passed_ours"] = sum(1 for t in ex if t["ours"] == "passed")
    groups: dict[str, list[str]] = {}
    if "ours" in variants:
        for i, t in tests.items():
            if t["ours"] not in ("passed", "skipped", "xfail"):
                groups.setdefault(f"{t['ours']}: {_normalize(t.get('ours_error'))}", []).append(i)
    out["counts"] = counts
    out["failure_groups_ours"] = dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))
    out["worker_restarts"] = {v: r["worker_restarts"] for v, r in variants.items()}
    out["cachedemb_imported_from"] = {v: r["cachedemb_file"] for v, r in variants.items()}
    if suite == "torchrec":
        out["torchrec_ir"] = {v: r["torchrec_ir"] for v, r in variants.items()}
    if "ours" in variants:
        out["swapped_in_modules"] = variants["ours"]["patched"]
        out["backend_seen_by_ours"] = variants["ours"]["backend"]
    out["tests"] = tests
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _git(*cmd) -> str | None:
    try:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _versions(env) -> dict:
    code = ("import json, torch\nv={'torch': torch.__version__}\n"
            "for m in ('torchrec', 'triton', 'fbgemm_gpu'):\n"
            "    try:\n        v[m]=__import__(m).__version__\n    except Exception as e:\n        v[m]=None\n"
            "import cachedemb\nv['cachedemb_imported_from']=cachedemb.__file__\n"
            "print(json.dumps(v))")
    try:
        p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                           timeout=300, cwd=tempfile.gettempdir())  # not the repo: '' would shadow PYTHONPATH
        return json.loads(p.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        return {}


def parent_main(args) -> int:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CACHEDEMB_BACKEND"] = args.backend
    if args.backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    if args.sync_free:
        env["CACHEDEMB_SYNC_FREE"] = "1"
    else:
        env.pop("CACHEDEMB_SYNC_FREE", None)
    env.setdefault("PYTHONWARNINGS", "ignore")
    suites = ["pytorch", "torchrec"] if args.suite == "all" else [args.suite]
    with tempfile.TemporaryDirectory(prefix="peer_suites_") as tmp:
        if args.code_at:
            # The code under test is cachedemb/ + kernels/ as committed at REV (the work tree may hold
            # colleagues' unfinished edits); first on PYTHONPATH, ahead of the editable install's finder.
            code_root = Path(tmp) / "code"
            code_root.mkdir()
            commit = _git("rev-parse", "--verify", f"{args.code_at}^{{commit}}")
            if commit is None:
                raise SystemExit(f"--code-at {args.code_at}: not a commit")
            archive = subprocess.run(["git", "archive", commit, "cachedemb", "kernels"], cwd=REPO,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(code_root)], input=archive, check=True)
            dirty = []
        else:
            code_root, commit = REPO, _git("rev-parse", "HEAD")
            status = _git("status", "--porcelain", "--untracked-files=no", "--", "cachedemb", "kernels")
            dirty = [line[3:] for line in (status or "").splitlines()]
        env["PYTHONPATH"] = os.pathsep.join([str(code_root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PEER_SUITES_CODE_ROOT"] = str(code_root)
        return _run_all(args, env, suites, commit, dirty, Path(tmp))


def _run_all(args, env, suites, commit, dirty, tmp: Path) -> int:
    run = {
        "machine": MACHINE,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "code_under_test": (f"cachedemb/ + kernels/ at {commit} (git archive)" if args.code_at else
                            "the work tree" + (f", uncommitted changes in {dirty}" if dirty else " (clean)")),
        "python": platform.python_version(),
        "versions": _versions(env),
        "command": "python scripts/peer_suites.py " + " ".join(args.argv),
        "config": {"suite": args.suite, "backend": args.backend, "sync_free": args.sync_free,
                   "env": {k: env[k] for k in ("CACHEDEMB_BACKEND", "TRITON_INTERPRET", "CACHEDEMB_SYNC_FREE")
                           if k in env},
                   "variants": args.variants, "filter": args.k},
        "suites": {},
    }
    t0 = time.perf_counter()
    for s in suites:
        run["suites"][s] = run_suite(args, s, env, tmp)
    run["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(run, indent=1)
    print(text)
    if args.out:
        out = Path(args.out)
        if args.merge and out.exists():
            doc = json.loads(out.read_text())
            key = (args.suite, args.backend, args.sync_free)
            doc["runs"] = [r for r in doc.get("runs", [])
                           if (r["config"]["suite"], r["config"]["backend"], r["config"]["sync_free"]) != key]
            doc["runs"].append(run)
        elif args.merge:
            doc = {"runs": [run]}
        else:
            doc = run
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    summary = {s: r["counts"] if "counts" in r else {v: e.get("error") for v, e in r["collect_errors"].items()}
               for s, r in run["suites"].items()}
    print(json.dumps({"summary": summary, "seconds": run["seconds"]}), file=sys.stderr)
    return 0 if all("counts" in r for r in run["suites"].values()) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("pytorch", "torchrec", "all"), default="all")
    p.add_argument("--backend", choices=("torch", "triton"), default="torch")
    p.add_argument("--sync-free", action="store_true")
    p.add_argument("--out")
    p.add_argument("--merge", action="store_true", help="--out holds {'runs': [...]}; replace this run's entry")
    p.add_argument("--pytorch-test-file", default=str(DEFAULT_PYTORCH_TEST_FILE))
    p.add_argument("--torchrec-dir", default=str(DEFAULT_TORCHREC_DIR))
    p.add_argument("--variants", default="stock,ours", type=lambda s: [v for v in s.split(",") if v])
    p.add_argument("--code-at", metavar="REV", help="test cachedemb/ + kernels/ as committed at REV "
                   "(git archive into a temp dir) instead of the work tree")
    p.add_argument("-k", default=None, help="only tests whose id contains this substring")
    p.add_argument("--test-timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("--worker-timeout", type=float, default=900.0, help="seconds per worker process")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_variant", choices=("stock", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--_results", help=argparse.SUPPRESS)
    p.add_argument("--_skip", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args._worker:
        return worker_main(args)
    bad = [v for v in args.variants if v not in ("stock", "ours")]
    if bad:
        p.error(f"--variants: unknown {bad}")
    if args.suite in ("pytorch", "all") and not Path(args.pytorch_test_file).is_file():
        p.error(f"{args.pytorch_test_file} not found: see this script's docstring for how to get it")
    if args.suite in ("torchrec", "all"):
        missing = [r for r in TORCHREC_TEST_FILES if not (Path(args.torchrec_dir) / r).is_file()]
        if missing:
            p.error(f"{missing} not under {args.torchrec_dir}: see this script's docstring")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
