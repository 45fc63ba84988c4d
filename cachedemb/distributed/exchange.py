"""The collectives between ranks, each an autograd Function whose backward runs the mirror collective.

Only `torch.distributed` ops: `all_to_all_single` with uneven splits (gloo on CPU, NCCL on GPU). Every rank
must call the same exchanges in the same order (forward and backward); a rank with an empty local batch
still takes part with zero-length splits. `ExchangeStats` counts the bytes each rank sends, for benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ExchangeStats:
    """Bytes this rank sent to other ranks (its own share to itself excluded), forward and backward."""

    bytes_sent: int = 0
    calls: int = 0

    def add(self, t: torch.Tensor, splits: list[int], rank: int) -> None:
        row = t[0].numel() * t.element_size() if t.shape[0] else 0
        self.bytes_sent += row * (sum(splits) - splits[rank])
        self.calls += 1


STATS = ExchangeStats()


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` (split `in_splits` by destination rank) to their ranks; returns the rows received, split
    `out_splits` by source rank. Not differentiable (ids, counts)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    STATS.add(x, in_splits, dist.get_rank(group))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class AllToAllRows(torch.autograd.Function):
    """all_to_all of rows; backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


class LocalSliceOfReplicated(torch.autograd.Function):
    """Data-parallel output: every rank computed the pooled bags of all ranks' batches ([sum_r B_r, D], sources
    in rank order); each keeps its own B_me rows. Backward gathers every rank's gradient rows, so every replica
    sees the gradient of the whole global batch and applies the same update."""

    @staticmethod
    def forward(ctx, full, bag_counts: list[int], rank: int, group):
        ctx.bag_counts, ctx.rank, ctx.group = bag_counts, rank, group
        start = sum(bag_counts[:rank])
        return full[start:start + bag_counts[rank]].clone()

    @staticmethod
    def backward(ctx, grad):
        world = len(ctx.bag_counts)
        mine = ctx.bag_counts[ctx.rank]
        send = grad.contiguous().repeat(world, 1) if grad.dim() == 2 else grad.repeat(world)
        return all_to_all(send, ctx.bag_counts, [mine] * world, ctx.group), None, None, None


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """send: [W, k] int64, row r for rank r; returns [W, k], row r what rank r sent to this rank."""
    world = send.shape[0]
    return all_to_all(send, [1] * world, [1] * world, group)
