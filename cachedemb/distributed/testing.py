"""Run a function on W spawned gloo processes (torchrec's multi-process test style), for tests and benchmarks.

`run_spawned(fn, world_size, *args)` starts W processes with torch.multiprocessing (spawn), each initializing a
gloo process group on a free local port with a collective timeout, calls `fn(rank, world_size, *args)`, and
returns the ranks' return values in rank order. A rank that raises fails the whole run with that rank's
traceback (torch.multiprocessing re-raises it); the others then fail at their next collective within the
timeout instead of hanging.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, timeout_s: float, results, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_spawned(fn, world_size: int, *args, timeout_s: float = 30.0) -> list:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; their return values (picklable) in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    context = mp.start_processes(_entry, args=(fn, world_size, free_port(), timeout_s, results, args),
                                 nprocs=world_size, start_method="spawn", join=False)
    got: dict[int, tuple] = {}
    failure = None
    try:
        while not context.join(timeout=0.5):
            _drain(results, got)
    except Exception as e:  # a rank raised or died: report every rank's error, the first to fail first
        failure = e
    finally:
        _drain(results, got)
        for p in context.processes:
            if p.is_alive():
                p.terminate()
    errors = [f"rank {r}:\n{v}" for r, (status, v) in got.items() if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors)) from failure
    if failure is not None:
        raise failure
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        raise RuntimeError(f"ranks {missing} returned nothing")
    return [got[r][1] for r in range(world_size)]


def _drain(results, got: dict) -> None:
    while True:
        try:
            rank, status, value = results.get_nowait()
        except queue.Empty:
            return
        got[rank] = (status, value)
