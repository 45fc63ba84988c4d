"""`import cachedemb` does not import Triton (on CPU every op runs its torch reference); the first Triton kernel
launch imports it and puts the real JITFunctions in every kernel module. Each check in a fresh interpreter."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def run(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("CACHEDEMB_BACKEND", "CACHEDEMB_SYNC_FREE")}
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_import_cachedemb_leaves_triton_unimported_and_cpu_training_never_needs_it():
    out = run("import sys, torch, cachedemb\n"
              "print('triton' in sys.modules)\n"
              "emb = cachedemb.CachedEmbeddingBag(50, 4, mode='sum', cache_rows=8, device='cpu',\n"
              "                                   optimizer=cachedemb.optim.Adagrad(lr=0.1))\n"
              "emb(torch.tensor([1, 2, 40, 2]), torch.tensor([0, 2])).sum().backward()\n"
              "print('triton' in sys.modules)")
    assert out.splitlines() == ["False", "False"]


def test_the_first_triton_launch_puts_the_real_kernels_in_place():
    out = run("import sys, torch, cachedemb\n"
              "import importlib\n"
              "bag_input, lazy_triton, unique_ids = (importlib.import_module(f'cachedemb.kernels.{m}')\n"
              "                                      for m in ('bag_input', 'lazy_triton', 'unique_ids'))\n"
              "assert 'triton' not in sys.modules\n"
              "assert any(isinstance(v, lazy_triton.LazyKernel) for v in vars(unique_ids).values())\n"
              "ids = torch.tensor([5, 3, 5, 9])\n"
              "ref = cachedemb.kernels.unique_ids_torch(ids, None)\n"
              "got = cachedemb.kernels.unique_ids(ids, None)\n"
              "assert all(torch.equal(a, b) for a, b in zip(ref[:4], got[:4]))\n"
              "import triton\n"
              "left = [k for m in list(sys.modules.values()) if getattr(m, '__name__', '').startswith('cachedemb.kernels')\n"
              "        for k, v in vars(m).items() if isinstance(v, lazy_triton.LazyKernel)]\n"
              "print('triton' in sys.modules, bag_input.triton is triton, bag_input.tl is triton.language, left)",
              CACHEDEMB_BACKEND="triton", TRITON_INTERPRET="1")
    assert out == "True True True []"
