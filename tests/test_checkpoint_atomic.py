"""Checkpoints survive a writer killed at any point: `cachedemb.save_checkpoint` (temp file in the same directory,
fsync, os.replace, directory fsync) leaves the previous checkpoint loadable and equal to what was saved, and
`cachedemb.load_checkpoint` (weights_only) round-trips a trained module but refuses a pickle that runs code."""
from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import cachedemb
import cachedemb.modules.checkpoint
from cachedemb.modules.checkpoint import load_checkpoint, save_checkpoint

# Each version k is a pure function of k, so the parent can rebuild what the writer saved.
_VERSION_SRC = textwrap.dedent("""
    import torch
    def version(k):
        g = torch.Generator().manual_seed(k)
        return {"step": k, "table": torch.randn(1 << 20, generator=g),  # 4 MiB: a write takes a while
                "state": {"sum": torch.arange(k + 1).sum(), "name": f"v{k}"}, "shape": [k, 2 * k]}
""")
_WRITER_SRC = _VERSION_SRC + textwrap.dedent("""
    import importlib.util, sys
    # The checkpoint module alone (no package import): a quick start, so more kills fit in the time.
    spec = importlib.util.spec_from_file_location("checkpoint", sys.argv[3])
    checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checkpoint)
    save_checkpoint = checkpoint.save_checkpoint
    path, first = sys.argv[1], int(sys.argv[2])
    k = first
    while True:
        save_checkpoint(version(k), path)
        print(k, flush=True)  # after the save returned: version k is durable
        k += 1
""")


def version(k):
    scope: dict = {}
    exec(_VERSION_SRC, scope)  # the same definition the writer runs
    return scope["version"](k)


def assert_version(loaded, k):
    expected = version(k)
    assert loaded["step"] == k and loaded["shape"] == expected["shape"] and loaded["state"]["name"] == f"v{k}"
    assert torch.equal(loaded["table"], expected["table"])
    assert torch.equal(loaded["state"]["sum"], expected["state"]["sum"])


def test_sigkill_at_random_points_keeps_the_previous_checkpoint(tmp_path, request):
    path = tmp_path / "latest.pt"
    writer = tmp_path / "writer.py"
    writer.write_text(_WRITER_SRC)
    save_checkpoint(version(0), path)
    rng = random.Random(1234)
    last = 0
    kills = 12 if request.config.getoption("--slow") else 3  # each kill starts a Python + torch (~3 s)
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, str(writer), str(path), str(last + 1), cachedemb.modules.checkpoint.__file__],
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        # Kill once the writer is up (its first line) plus a random delay: before, inside or between saves.
        first = proc.stdout.readline()
        assert first.strip(), "writer died before its first save"
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        reported = [int(x) for x in (first + rest).split()]
        loaded = load_checkpoint(path)
        # The last reported save is durable; the next one may have completed between its rename and its print.
        assert loaded["step"] in (reported[-1], reported[-1] + 1), (loaded["step"], reported[-1])
        assert_version(loaded, loaded["step"])
        last = loaded["step"]
    # Temp files of killed saves never shadow the checkpoint; only `latest.pt` and its leftovers exist.
    assert {p.name for p in tmp_path.iterdir()} - {"latest.pt", "writer.py"} <= {
        p.name for p in tmp_path.glob(".latest.pt.*.tmp")}


def test_failed_save_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(version(3), path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        save_checkpoint({"bad": Unpicklable()}, path)
    assert_version(load_checkpoint(path), 3)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_checkpoint(version(1), tmp_path / "missing_dir" / "ckpt.pt")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(tmp_path / "nope.pt")


def test_module_state_round_trips(tmp_path):
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(40, 4, mode="sum", cache_rows=5, device="cpu",
                                       optimizer=cachedemb.optim.Adam(lr=0.1))
    for step in range(4):
        ids = torch.randint(0, 40, (12,), generator=torch.Generator().manual_seed(step))
        emb(ids, torch.tensor([0, 5])).sum().backward()
    path = tmp_path / "emb.pt"
    save_checkpoint(emb.state_dict(), path)
    fresh = cachedemb.CachedEmbeddingBag(40, 4, mode="sum", cache_rows=5, device="cpu",
                                         optimizer=cachedemb.optim.Adam(lr=0.1))
    fresh.load_state_dict(load_checkpoint(path))
    for key, value in emb.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


class _RunsCode:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["CACHEDEMB_PWNED"]),))


def test_load_refuses_pickled_code(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("CACHEDEMB_PWNED", str(marker))
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": _RunsCode()}, path)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)
    assert not marker.exists()
