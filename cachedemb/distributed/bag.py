"""ShardedEmbeddingBag: one CachedEmbeddingBag's table placed over the ranks of a process group.

Data flow of one forward (every rank, its own local batch of B_me bags, possibly empty)::

    input, offsets ──normalize──> ids, bag of each lookup (padding lookups dropped)
        │  owner of each id: the rank whose row range holds it (data-parallel: every rank)
        ├─ all_to_all  [counts, bags]            (W x 2 int64)
        ├─ all_to_all  ids - row start, bag      (uneven splits)        ┐ not differentiable
        ├─ all_to_all  per-sample weights        (AllToAllRows)         ┘
        v
    owner: one local CachedEmbeddingBag call over the bags of all sources (sum_r B_r bags, sources in rank
    order), pooled "sum" (or "max"): the partial bags of its rows
        │  row/table-wise: all_to_all back (AllToAllRows): each owner returns B_r partial rows to rank r
        │  data-parallel: keep own B_me rows (LocalSliceOfReplicated)
        v
    combine per bag over owners: sum; mean = sum / lookups; max = max over owners that saw a lookup (else 0)

Backward mirrors it: pooled gradients go back to the owners (the reverse all_to_all, or for data-parallel
an all-gather of every rank's gradient rows), and the owner's local module applies its fused optimizer to its
rows once per step (its step count moves on every owner, as the single-process module's does) or leaves an
id-space gradient on its local `weight` (optimizer=None). Each lookup's gradient is computed where its row
lives, so training equals the single-process module trained on the concatenation of all ranks' batches with
the sum of the ranks' losses (torchrec's convention; DDP averages the dense gradients instead).
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cachedemb.distributed.exchange import AllToAllRows, LocalSliceOfReplicated, all_to_all, exchange_counts
from cachedemb.distributed.files import rank_table
from cachedemb.distributed.plan import ShardingType, TableSharding
from cachedemb.modules.batch_input import batch_input_args
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.cache.embedding_cache import pinned_empty
from cachedemb.modules.input_check import normalize_bag_input
from cachedemb.modules.meta_init import init_rows
from cachedemb.storage.embedding_bag import FileBackedEmbeddingBag


def lookups_with_bags(ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None, pad_id):
    """Each lookup's id, bag and weight, padding lookups dropped: what travels to the ids' owners."""
    bag_of = torch.repeat_interleave(torch.arange(offsets.numel() - 1, dtype=torch.int64, device=ids.device),
                                     offsets.diff())
    if pad_id is not None:
        keep = ids != pad_id
        ids, bag_of = ids[keep], bag_of[keep]
        psw = psw[keep] if psw is not None else None
    return ids, bag_of, psw


def local_shard(module: CachedEmbeddingBag, start: int, end: int, device: torch.device, pooling: str,
                rank: int = 0, world_size: int = 1) -> CachedEmbeddingBag | FileBackedEmbeddingBag | None:
    """A CachedEmbeddingBag over rows [start, end) of `module` (their current values and optimizer state),
    ids local to the range, bags given with the end offset, padding already dropped; None for an empty range.
    A module on the meta device gets the rows one process would draw for it (`cachedemb.materialize`): every
    rank replays the table's whole random stream, keeping its rows (even none), so generators stay in step."""
    rows = end - start
    if module.is_meta and module.file_storage is not None:  # storage= on meta: this rank's file of its rows
        return rank_table(module, start, end, rank, world_size, device, pooling)
    if module.is_meta:
        spec = module.cache
        weight = init_rows(spec.init, module.num_embeddings, module.embedding_dim, spec.dtype, start, end,
                           out=pinned_empty((rows, module.embedding_dim), spec.dtype))
        freq = spec.id_freq[start:end].clone() if spec.id_freq is not None else None
        capacity, policy, dtype = spec.capacity, spec.policy, spec.dtype
        warmup = {"warmup_ratio": spec.warmup_ratio}
    else:
        module.flush()
        cache = module.cache
        weight = cache.host_weight[start:end].clone() if rows else None
        freq = cache.host_freq[start:end].clone() if rows else None
        capacity, policy, dtype = cache.capacity, cache.policy, cache.dtype
        warmup = {}  # the constructor's default, as before
    if rows == 0:
        return None
    shard = CachedEmbeddingBag(
        rows, module.embedding_dim, max_norm=module.max_norm, norm_type=module.norm_type,
        scale_grad_by_freq=module.scale_grad_by_freq, mode=pooling, sparse=module.sparse, _weight=weight,
        include_last_offset=True, device=device, dtype=dtype,
        _freeze=module.optimizer is None and not module._table.requires_grad,
        cache_rows=max(1, min(rows, math.ceil(capacity * rows / module.num_embeddings))),
        optimizer=module.optimizer, id_freq=freq, policy=policy, validate_inputs=False, **warmup)
    if not module.is_meta:
        for name, state in module.cache.host_states.items():
            shard.cache.host_states[name].copy_(state[start:end])
        shard.optimizer_step = module.optimizer_step
        shard.cache.reload()
    shard._shard_local = True
    return shard


def rank_cuda_device() -> torch.device:
    """This rank's GPU: LOCAL_RANK (as torchrun sets it), else the current device."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))


def exchanges_cuda(group=None) -> bool:
    """Whether the group's backend exchanges CUDA tensors (NCCL, alone or as the "cuda:nccl" of a device map):
    a gloo job is a CPU job even on a machine with GPUs."""
    return "nccl" in str(dist.get_backend(group if group is not None else dist.group.WORLD)).lower()


def default_cache_device(group=None) -> torch.device:
    """Where a meta module's shard keeps its cache: this rank's GPU when there is one and the group exchanges
    CUDA tensors; else host memory."""
    return rank_cuda_device() if torch.cuda.is_available() and exchanges_cuda(group) else torch.device("cpu")


@dataclass
class ExchangedInput:
    """One local batch after the input all-to-all: what the owner looks up (`local_ids`, `local_offsets`
    over the bags of every source rank, `recv_psw`) and what this rank needs to combine its pooled parts."""

    n_input: int  # ids the caller passed (to check that a forward is the batch prefetched for it)
    n_bags: int
    ids: torch.Tensor  # this rank's lookups (padding dropped), and the bag of each
    bag_of: torch.Tensor
    owner: torch.Tensor | None  # owner rank of each lookup (None: data-parallel)
    lead: int
    trail: int
    last_bag_scale: object
    recv_bags: list[int]  # bags of each source rank
    local_ids: torch.Tensor  # ids received, local to this rank's rows
    local_offsets: torch.Tensor | None  # None when this rank keeps no rows
    recv_psw: torch.Tensor | None


class ShardedEmbeddingBag(nn.Module):
    """The sharded equivalent of a CachedEmbeddingBag: same forward signature and outputs; this rank keeps
    rows `sharding.ranges[rank]` in `self.shard` (None when it keeps none)."""

    # prefetch_targets(batch) takes the batch's input by position (modules/batch_input.py): cachedemb.prefetch
    # refuses a default extraction shared by several such modules.
    reads_batch_by_position = True

    def __init__(self, module: CachedEmbeddingBag, sharding: TableSharding, group=None, device=None):
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if sharding.world_size != self.world_size:
            raise ValueError(f"the plan places this table over {sharding.world_size} ranks, the process group "
                             f"has {self.world_size}")
        if sharding.num_embeddings != module.num_embeddings:
            raise ValueError(f"the plan is for a table of {sharding.num_embeddings} rows, the module has "
                             f"{module.num_embeddings}")
        self.sharding = sharding
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.mode, self.padding_idx = module.mode, module.padding_idx
        self.include_last_offset, self.optimizer = module.include_last_offset, module.optimizer
        self.dtype = module.cache.dtype
        self.row_start, self.row_end = sharding.ranges[self.rank]
        self.owners = sharding.owners()
        # Owners in row order: lookups find theirs by a binary search over the owners' range ends.
        by_row = sorted(self.owners, key=lambda r: sharding.ranges[r][0])
        self._owner_by_row = torch.tensor(by_row, dtype=torch.int64)
        self._owner_ends = torch.tensor([sharding.ranges[r][1] for r in by_row], dtype=torch.int64)
        self._starts = torch.tensor([a for a, _ in sharding.ranges], dtype=torch.int64)
        if device is None:
            device = module.cache.device if not module.is_meta else default_cache_device(self.group)
        # A table built on meta with storage=FileStorage(...): this rank's rows live in a file of its own.
        self.on_file = module.is_meta and module.file_storage is not None
        shard = local_shard(module, self.row_start, self.row_end, device, "max" if self.mode == "max" else "sum",
                            self.rank, self.world_size)
        if self.on_file:  # not a child: its state is the file (state_dict() would commit a snapshot per call);
            object.__setattr__(self, "shard", shard)  # checkpoints name snapshots (distributed.checkpoint)
        else:
            self.shard = shard
        self._prefetched: deque[ExchangedInput] = deque()  # exchanged ahead by cachedemb.prefetch, in order
        self._armed = False

    @property
    def data_parallel(self) -> bool:
        return self.sharding.sharding_type == ShardingType.DATA_PARALLEL

    def forward(self, input, offsets=None, per_sample_weights=None):
        exchanged = self._take_prefetched(input)
        if exchanged is None:
            exchanged = self.input_dist(input, offsets, per_sample_weights)
        return self.compute(exchanged)

    def input_dist(self, input, offsets=None, per_sample_weights=None) -> ExchangedInput:
        """The input all-to-all of one local batch: ids to their owners (collective: every rank calls it for
        its own batch, in the same order). `cachedemb.prefetch` runs it ahead of the forward."""
        bags = normalize_bag_input(input, offsets, per_sample_weights, mode=self.mode,
                                   include_last_offset=self.include_last_offset, num_embeddings=self.num_embeddings,
                                   device=input.device, validate=True, padding_idx=self.padding_idx,
                                   table_dtype=self.dtype)
        n_bags = bags.offsets.numel() - 1
        ids, bag_of, psw = lookups_with_bags(bags.ids, bags.offsets, bags.per_sample_weights, bags.pad_id)
        world, group = self.world_size, self.group
        owner = None
        if self.data_parallel:
            send_counts = [ids.numel()] * world
            payload = torch.stack([ids, bag_of], 1).repeat(world, 1)
            psw_send = psw.repeat(world) if psw is not None else None
        else:
            slot = torch.bucketize(ids, self._owner_ends.to(ids.device), right=True)
            owner = self._owner_by_row.to(ids.device)[slot]
            order = torch.argsort(owner, stable=True)
            owner_sorted = owner[order]
            send_counts = torch.bincount(owner, minlength=world).tolist()
            local_ids = ids[order] - self._starts.to(ids.device)[owner_sorted]
            payload = torch.stack([local_ids, bag_of[order]], 1)
            psw_send = psw[order] if psw is not None else None
        # The split sizes must be on the host (all_to_all_single takes lists): one count exchange per batch.
        header = torch.tensor([[c, n_bags] for c in send_counts], dtype=torch.int64, device=ids.device)
        recv_header = exchange_counts(header, group).cpu()
        recv_counts, recv_bags = recv_header[:, 0].tolist(), recv_header[:, 1].tolist()
        recv = all_to_all(payload, recv_counts, send_counts, group)
        recv_psw = AllToAllRows.apply(psw_send, recv_counts, send_counts, group) if psw is not None else None
        local_offsets = None
        if self.shard is not None:
            total = sum(recv_bags)
            source = torch.repeat_interleave(torch.arange(world, dtype=torch.int64), torch.tensor(recv_counts))
            base = torch.tensor([0] + recv_bags[:-1], dtype=torch.int64).cumsum(0)
            global_bag = recv[:, 1] + base[source].to(recv.device)
            local_offsets = torch.zeros(total + 1, dtype=torch.int64, device=recv.device)
            local_offsets[1:] = torch.bincount(global_bag, minlength=total).cumsum(0)
        return ExchangedInput(input.numel(), n_bags, ids, bag_of, owner, bags.lead, bags.trail,
                              bags.last_bag_scale, recv_bags, recv[:, 0], local_offsets, recv_psw)

    def compute(self, x: ExchangedInput) -> torch.Tensor:
        """Owner-side lookup of the exchanged ids, pooled parts back by all-to-all, combined per bag."""
        world, group = self.world_size, self.group
        if self.shard is not None:
            partial = self.shard(x.local_ids, x.local_offsets, x.recv_psw)
        else:
            partial = torch.zeros(0, self.embedding_dim, dtype=self.dtype, device=x.ids.device, requires_grad=True)
        if self.data_parallel:
            pooled = LocalSliceOfReplicated.apply(partial, x.recv_bags, self.rank, group)
            out = self._finish(pooled.unsqueeze(0), x.ids, x.bag_of, x.n_bags, per_owner=None)
        else:
            n_bags = x.n_bags
            back_in = [x.recv_bags[r] if self.shard is not None else 0 for r in range(world)]
            back_out = [n_bags if r in self.owners else 0 for r in range(world)]
            parts = AllToAllRows.apply(partial, back_out, back_in, group)
            parts = parts.view(len(self.owners), n_bags, self.embedding_dim)
            per_owner = None
            if self.mode == "max" and len(self.owners) > 1:
                index = x.owner * n_bags + x.bag_of
                per_owner = torch.bincount(index, minlength=world * n_bags).view(world, n_bags)[self.owners]
            out = self._finish(parts, x.ids, x.bag_of, n_bags, per_owner)
        if x.lead or x.trail:
            out = out[x.lead: out.shape[0] - x.trail]
        if x.last_bag_scale is not None and out.shape[0] > 0:
            factor = torch.ones(out.shape[0], 1, dtype=torch.float64, device=out.device)
            factor[-1] = x.last_bag_scale
            out = out * factor.to(out.dtype)
        return out

    # -------------------------------------------------------------- prefetch
    def prefetch_targets(self, batch) -> list:
        """`cachedemb.prefetch` protocol: run this batch's input all-to-all now (ahead of its forward, as
        torchrec's sparse-dist pipeline does) and return (shard cache, the ids this rank owns for it); the
        batch's forward then uses the exchanged input. `batch`: input tensor, (input, offsets[, weights])
        tuple, or dict with "input" (and "offsets", "per_sample_weights")."""
        return self.prefetch_exchange(*batch_input_args(batch))

    def prefetch_exchange(self, input, offsets=None, per_sample_weights=None) -> list:
        """Exchange one batch ahead and queue it for the forward `on_prefetch_yield` arms."""
        exchanged = self.input_dist(input, offsets, per_sample_weights)
        self._prefetched.append(exchanged)
        if self.on_file:  # the rank's file reads run ahead (the file-backed module's own prefetch stage)
            return self.shard.prefetch_targets(exchanged.local_ids) if self.shard is not None else []
        return [(self.shard.cache, exchanged.local_ids)] if self.shard is not None else []

    def on_prefetch_yield(self) -> None:
        """The prefetcher yields the next batch: this module's next forward is that batch's (the oldest
        queued exchange), as the prefetcher takes the first forward per cache after a yield."""
        self._armed = bool(self._prefetched)

    def on_prefetch_end(self) -> None:
        """The prefetch loop ended (possibly early): batches exchanged ahead but never consumed are dropped
        (every rank dropped the same ones, so later exchanges stay in step)."""
        self._prefetched.clear()
        self._armed = False

    def _take_prefetched(self, input) -> ExchangedInput | None:
        if not self._armed:
            return None
        self._armed = False
        exchanged = self._prefetched.popleft()
        if torch.is_tensor(input) and input.numel() != exchanged.n_input:
            raise RuntimeError(f"the forward under cachedemb.prefetch got {input.numel()} ids, but the batch the "
                               f"prefetcher yielded has {exchanged.n_input}: the first forward after each yield "
                               "must be that batch's (run other forwards after it)")
        return exchanged

    def _finish(self, parts, ids, bag_of, n_bags: int, per_owner) -> torch.Tensor:
        """parts: [owners, B, D] partial pools -> [B, D]."""
        if self.mode == "max":
            if per_owner is None:
                return parts.sum(0)  # one owner saw every lookup: its max pooling is already final
            per_owner = per_owner.to(parts.device)  # the exchange's device (gloo: host) to the pools'
            masked = parts.masked_fill((per_owner == 0).unsqueeze(-1), float("-inf"))
            best = masked.max(0).values
            return torch.where((per_owner.sum(0) > 0).unsqueeze(-1), best, torch.zeros_like(best))
        pooled = parts.sum(0)
        if self.mode == "mean":
            counts = torch.bincount(bag_of, minlength=n_bags).clamp(min=1)
            pooled = pooled / counts.unsqueeze(1).to(pooled.device, pooled.dtype)
        return pooled

    # ----------------------------------------------------------------- state
    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's rows and their optimizer state (host tensors, flushed), keyed as the unsharded
        module's state_dict; empty when the rank keeps no rows."""
        if self.shard is None:
            return {}
        if self.on_file:  # read from the file chunk by chunk into memory: for export (gather_full_state_dict)
            return self.shard.export_state_dict()
        self.shard.flush()
        cache = self.shard.cache
        state = {"weight": cache.host_weight}
        for name, value in cache.host_states.items():
            state[f"optimizer.{name}"] = value
        if self.optimizer is not None:
            state["optimizer.step"] = torch.tensor(self.shard.optimizer_step, dtype=torch.int64)
        return state

    def state_keys(self) -> list[str]:
        """The unsharded module's state_dict keys."""
        keys = ["weight"]
        if self.optimizer is not None:
            keys += [f"optimizer.{name}" for name in self.optimizer.state_layout(self.embedding_dim)]
            keys.append("optimizer.step")
        return keys

    def state_columns(self, key: str) -> int:
        if key == "weight":
            return self.embedding_dim
        return self.optimizer.state_layout(self.embedding_dim)[key.split(".", 1)[1]][0]

    def after_load(self, step: int | None) -> None:
        """Rows were written into the host tensors in place (checkpoint load): re-read the cache."""
        if self.shard is None or self.on_file:
            return
        if step is not None and self.optimizer is not None:
            self.shard.optimizer_step = step
        self.shard.cache.reload()

    def load_local_state(self, full_rows: dict[str, torch.Tensor]) -> None:
        """Copy this rank's rows [row_start, row_end) out of full-table tensors (keys as local_state)."""
        if self.on_file:
            raise ValueError("a sharded table on file loads snapshot descriptors (cachedemb.distributed.checkpoint), "
                             "not rows: import rows into new files with CachedEmbeddingBag.from_pretrained(rows, "
                             "storage=...) in one process")
        if self.shard is None:
            return
        self.shard.flush()
        a, b = self.row_start, self.row_end
        cache = self.shard.cache
        cache.host_weight.copy_(full_rows["weight"][a:b])
        for name, value in cache.host_states.items():
            key = f"optimizer.{name}"
            if key in full_rows:
                value.copy_(full_rows[key][a:b])
        if "optimizer.step" in full_rows and self.optimizer is not None:
            self.shard.optimizer_step = int(full_rows["optimizer.step"])
        cache.reload()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.on_file and self.shard is not None:
            self.shard.train(mode)
        return self

    def close(self) -> None:
        """Commit and close this rank's table file (a table on file; also done at exit)."""
        if self.on_file and self.shard is not None:
            self.shard.close()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, {self.sharding.describe()}, "
                f"rank {self.rank} keeps [{self.row_start}, {self.row_end})")
