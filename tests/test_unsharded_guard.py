"""A cached module in a multi-process job that was not sharded refuses to run (each rank would otherwise train
its own diverging copy of the table), naming cachedemb.distributed.shard()."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cachedemb


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        module = cachedemb.CachedEmbeddingBag(10, 2, cache_rows=2, device="cpu")
        host = module.cache.host_weight.clone()
        try:
            module(torch.tensor([1, 2]), torch.tensor([0]))
            results.put((rank, "ran", True))
        except RuntimeError as e:
            results.put((rank, str(e), torch.equal(host, module.cache.host_weight)))
        local = cachedemb.CachedEmbeddingBag(10, 2, cache_rows=2, device="cpu")
        local._shard_local = True  # what the sharded modules mark their per-rank shards with
        results.put((rank, "shard ran", tuple(local(torch.tensor([1, 2]), torch.tensor([0])).shape)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_unsharded_module_refuses_under_world_size_two():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(_free_port(), results), nprocs=2, start_method="spawn")
    got = sorted(results.get(timeout=60) for _ in range(4))
    errors = [g for g in got if g[1] != "shard ran"]
    assert len(errors) == 2
    for _rank, message, unchanged in errors:
        assert "cachedemb.distributed.shard" in message and "2 processes" in message
        assert unchanged is True
    assert all(g[2] == (1, 2) for g in got if g[1] == "shard ran")
