"""Checkpoints of a file-backed table survive a writer killed at any moment: `save_checkpoint(model.state_dict())`
commits a snapshot of the file (no rows through memory) and names it in the checkpoint; after a SIGKILL the file
says its writer died, `recover=True` opens the last snapshot, and loading the checkpoint gives exactly the table
an in-memory module had after the same steps (the file keeps the snapshot a half-written checkpoint replaced)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import cachedemb
from cachedemb.storage.format import TableWriterDiedError

pytestmark = [pytest.mark.usefixtures("write_mode")]  # each file written in place and as a log

_SETUP = textwrap.dedent("""
    import torch, cachedemb
    N, D = 3000, 8
    SPEC = cachedemb.optim.Adam(lr=0.01)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        ids = (torch.rand(64, generator=g) ** 3 * N).long()
        return ids, torch.arange(0, 64, 8), torch.randn(8, D, generator=g)

    def train_step(module, step):
        ids, offsets, target = batch(step)
        (torch.tanh(module(ids, offsets)) * target).sum().backward()
""")
_WRITER = _SETUP + textwrap.dedent("""
    import os, sys
    path, ckpt = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=16, optimizer=SPEC, device="cpu",
                                       storage=cachedemb.FileStorage(path, host_cache_bytes=40_000, recover=True))
    step = 0
    if os.path.exists(ckpt):
        state = cachedemb.load_checkpoint(ckpt)
        emb.load_state_dict(state["model"])
        step = int(state["step"])
    while True:
        train_step(emb, step)
        step += 1
        cachedemb.save_checkpoint({"model": emb.state_dict(), "step": step}, ckpt)
        print(step, flush=True)  # after the save returned: step `step` is durable
""")


def _scope():
    scope: dict = {}
    exec(_SETUP, scope)
    return scope


def test_sigkill_at_random_points_keeps_the_last_checkpoint(tmp_path, request):
    s = _scope()
    path, ckpt, writer = tmp_path / "table.cemb", tmp_path / "ckpt.pt", tmp_path / "writer.py"
    writer.write_text(_WRITER)
    torch.manual_seed(0)
    ref = cachedemb.CachedEmbeddingBag(s["N"], s["D"], mode="sum", cache_rows=16, optimizer=s["SPEC"], device="cpu")
    ref_step = 0
    rng = random.Random(23)
    kills = 8 if request.config.getoption("--slow") else 3
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, str(writer), str(path), str(ckpt)], stdout=subprocess.PIPE,
                                text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        first = proc.stdout.readline()
        assert first.strip(), "writer died before its first save"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        reported = [int(x) for x in (first + rest).split()]
        with pytest.raises(TableWriterDiedError, match=f"{path}.*not closed by its last writer.*recover=True"):
            cachedemb.open_table(path)
        state = cachedemb.load_checkpoint(ckpt)
        saved = int(state["step"])
        assert saved in (reported[-1], reported[-1] + 1), (saved, reported[-1])
        emb = cachedemb.CachedEmbeddingBag(s["N"], s["D"], mode="sum", cache_rows=16, optimizer=s["SPEC"],
                                           device="cpu", storage=cachedemb.FileStorage(path, 40_000, recover=True))
        emb.load_state_dict(state["model"])
        while ref_step < saved:
            s["train_step"](ref, ref_step)
            ref_step += 1
        got = emb.export_state_dict()
        for key, value in ref.state_dict().items():
            assert torch.equal(value, got[key]), (key, saved)
        emb.table.close()  # released without a commit: the next writer continues from the checkpoint
    # nothing but the table, the checkpoint, the writer and leftover temporaries of killed saves
    assert {p.name for p in tmp_path.iterdir()} - {"table.cemb", "ckpt.pt", "writer.py"} <= {
        p.name for p in tmp_path.glob(".ckpt.pt.*.tmp")}


def test_checkpoint_survives_a_failed_save(tmp_path):
    """A save whose checkpoint write fails after its snapshot was committed: the previous checkpoint still
    loads (its snapshot is the one the file retains besides the newest)."""
    s = _scope()
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(s["N"], s["D"], mode="sum", cache_rows=16, optimizer=s["SPEC"], device="cpu",
                                       storage=cachedemb.FileStorage(tmp_path / "t.cemb", 40_000))
    torch.manual_seed(0)
    ref = cachedemb.CachedEmbeddingBag(s["N"], s["D"], mode="sum", cache_rows=16, optimizer=s["SPEC"], device="cpu")
    for step in range(3):
        s["train_step"](emb, step), s["train_step"](ref, step)
    cachedemb.save_checkpoint({"model": emb.state_dict()}, tmp_path / "ckpt.pt")
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    s["train_step"](emb, 3)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        cachedemb.save_checkpoint({"model": emb.state_dict(), "bad": Unpicklable()}, tmp_path / "ckpt.pt")
    emb.load_state_dict(cachedemb.load_checkpoint(tmp_path / "ckpt.pt")["model"])
    got = emb.export_state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    emb.close()
