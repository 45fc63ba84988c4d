"""CachedEmbeddingBag: nn.EmbeddingBag's interface over a host-resident table with a device cache."""
from __future__ import annotations

import math

import torch
from torch import nn

from cachedemb import kernels
from cachedemb.cache import BatchPlan, EmbeddingCache, pinned_empty
from cachedemb.errors import InvalidPaddingIdxError
from cachedemb.input_check import BagInput, normalize_bag_input
from cachedemb.optim import SparseOptimizer
from cachedemb.policy import Policy

_STEP_KEY = "optimizer.step"


class _PooledLookup(torch.autograd.Function):
    """Pooled forward over cache rows; backward either applies the fused optimizer in place (and returns no
    gradient for the rows) or hands the rows' gradient to autograd (optimizer=None)."""

    @staticmethod
    def forward(ctx, owner, plan: BatchPlan, bags: BagInput, rows, psw, anchor):
        host_rows = owner.cache.host_weight
        out, max_pos = kernels.pooled_forward(rows, plan.loc_u, plan.inverse, bags.offsets, bags.mode, psw,
                                              host_rows)
        ctx.owner, ctx.plan, ctx.bags, ctx.max_pos = owner, plan, bags, max_pos
        ctx.save_for_backward(psw)
        if bags.lead or bags.trail:
            out = out[bags.lead: out.shape[0] - bags.trail]  # phantom bags of unvalidated offsets
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        owner: CachedEmbeddingBag = ctx.owner
        plan, bags = ctx.plan, ctx.bags
        (psw,) = ctx.saved_tensors
        cache = owner.cache
        if plan.generation != cache.generation:
            raise RuntimeError(
                "CachedEmbeddingBag: backward of a batch whose cache rows were moved by a later forward or "
                f"prefetch admission (batch generation {plan.generation}, cache generation {cache.generation}). "
                "Run backward before the next forward of the same module (and before asking a prefetch "
                "pipeline for the next batch)."
            )
        grad_out = grad_out.contiguous()
        if bags.lead or bags.trail:
            dim = grad_out.shape[1]
            grad_out = torch.cat([grad_out.new_zeros(bags.lead, dim), grad_out, grad_out.new_zeros(bags.trail, dim)])
        rows = cache.rows.data
        grad_psw = None
        if psw is not None and ctx.needs_input_grad[4]:
            grad_psw = kernels.per_sample_weights_grad(grad_out, rows, plan.loc_u, plan.inverse, bags.offsets,
                                                       cache.host_weight)
            grad_psw = grad_psw.to(psw.dtype)
        psw_values = psw.detach().reshape(-1) if psw is not None else None
        grad_rows = None
        if owner.optimizer is not None:
            owner.optimizer_step += 1
            rule = owner.optimizer.rule(owner.optimizer_step)
            names = list(cache.host_states)
            kernels.backward_update(rows, [cache.states[k] for k in names], plan.loc_u, plan.n_uniq, grad_out,
                                    plan.inverse, bags.offsets, bags.mode, psw_values, ctx.max_pos, rule,
                                    cache.host_weight, [cache.host_states[k] for k in names])
            cache.mark_dirty(plan)
        elif ctx.needs_input_grad[3]:
            grad_rows = owner._rows_grad(plan, bags, grad_out, psw_values, ctx.max_pos)
        return None, None, None, grad_rows, grad_psw, None


class CachedEmbeddingBag(nn.Module):
    """A drop-in `nn.EmbeddingBag` whose full table (and every row's optimizer state) lives in host memory,
    pinned when CUDA exists, while a device cache holds `cache_rows` (default `cache_ratio` of the rows).

    Results equal `nn.EmbeddingBag` on the full table for every mode and input form, at any cache size:
    a batch with more unique ids than the cache is served through spill slots. With `optimizer=` one of
    `cachedemb.optim` the touched rows are updated inside backward (fused, one step per backward), with state
    kept per id, so training equals full-table training. With `optimizer=None` the cached rows are the
    Parameter `cache_weight` and a plain `torch.optim.SGD(model.parameters())` trains exactly like
    nn.EmbeddingBag — but a *stateful* torch optimizer (momentum, Adam, Adagrad, weight decay) would keep its
    state per cache slot, not per id, and leak it to whichever id reuses the slot: use `cachedemb.optim`.
    In that mode call `optimizer.step()` after each backward (no gradient accumulation across batches).

    Example (mode="sum")::

        >>> emb = CachedEmbeddingBag(10, 3, mode="sum", cache_rows=2)
        >>> input = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])   # 8 ids
        >>> offsets = torch.tensor([0, 4])                    # bag 0 = ids[0:4], bag 1 = ids[4:8]
        >>> emb(input, offsets).shape                          # 2 bags, 4 distinct rows each > 2 cached rows
        torch.Size([2, 3])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = False, _weight: torch.Tensor | None = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device=None, dtype=None, *, cache_ratio: float = 0.01,
                 cache_rows: int | None = None, optimizer: SparseOptimizer | None = None,
                 id_freq: torch.Tensor | None = None, warmup_ratio: float = 0.7, policy: str | Policy = "lfu",
                 validate_inputs: bool = True, stats_history: int = 0, freq_halflife: int | None = None):
        super().__init__()
        self._check_args(num_embeddings, embedding_dim, max_norm, scale_grad_by_freq, mode, cache_ratio,
                         cache_rows, optimizer, warmup_ratio, _weight)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, norm_type, scale_grad_by_freq
        self.mode, self.sparse, self.include_last_offset = mode, sparse, include_last_offset
        self.padding_idx = self._check_padding_idx(padding_idx)
        self.optimizer, self.optimizer_step = optimizer, 0
        self.validate_inputs = validate_inputs
        dtype = dtype or (_weight.dtype if _weight is not None else torch.get_default_dtype())
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        capacity = int(cache_rows) if cache_rows is not None else math.ceil(cache_ratio * num_embeddings)
        capacity = max(1, min(capacity, num_embeddings))
        host_weight = self._host_table(_weight, dtype)
        freq = self._check_id_freq(id_freq)
        state_layout = optimizer.state_layout(embedding_dim) if optimizer is not None else {}
        self.cache = EmbeddingCache(host_weight, capacity, torch.device(device), state_layout, policy, freq,
                                    history=stats_history, freq_halflife=freq_halflife)
        self.cache_weight = self.cache.rows
        self.cache_weight.requires_grad_(optimizer is None)
        # Fused mode: a zero-size tensor that requires grad makes autograd call our backward.
        self._anchor = torch.zeros(0, requires_grad=True)
        if freq is not None and warmup_ratio > 0:
            hottest = min(int(warmup_ratio * capacity), num_embeddings)
            if hottest > 0:
                self.cache.preload(torch.topk(freq, hottest, sorted=True).indices.sort().values)

    # ----------------------------------------------------------------- construction helpers
    @staticmethod
    def _check_args(num_embeddings, embedding_dim, max_norm, scale_grad_by_freq, mode, cache_ratio,
                    cache_rows, optimizer, warmup_ratio, weight):
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ValueError(f"num_embeddings must be a positive int, got {num_embeddings!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if max_norm is not None:
            raise NotImplementedError("max_norm is not supported by CachedEmbeddingBag (it would renormalize "
                                      "host rows in forward); renormalize the table yourself or leave it None")
        if scale_grad_by_freq:
            raise NotImplementedError("scale_grad_by_freq=True is not supported by CachedEmbeddingBag")
        if mode not in kernels.MODES:
            raise ValueError(f"mode must be one of {sorted(kernels.MODES)}, got {mode!r}")
        if cache_rows is None and not (isinstance(cache_ratio, (int, float)) and 0 < cache_ratio <= 1):
            raise ValueError(f"cache_ratio must be in (0, 1], got {cache_ratio!r}")
        if cache_rows is not None and (not isinstance(cache_rows, int) or cache_rows < 1):
            raise ValueError(f"cache_rows must be a positive int, got {cache_rows!r}")
        if optimizer is not None and not isinstance(optimizer, SparseOptimizer):
            raise TypeError(f"optimizer must be a cachedemb.optim spec (SGD, Adagrad, RowWiseAdagrad, Adam) or "
                            f"None, got {type(optimizer).__name__}; torch.optim optimizers go on parameters()")
        if not 0 <= warmup_ratio <= 1:
            raise ValueError(f"warmup_ratio must be in [0, 1], got {warmup_ratio!r}")
        if weight is not None and tuple(weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"_weight must have shape ({num_embeddings}, {embedding_dim}), "
                             f"got {tuple(weight.shape)}")

    def _check_padding_idx(self, padding_idx):
        if padding_idx is None:
            return None
        n = self.num_embeddings
        if not -n <= padding_idx < n:
            raise InvalidPaddingIdxError(f"padding_idx must be within [-{n}, {n}), got {padding_idx}")
        return padding_idx + n if padding_idx < 0 else padding_idx

    def _check_id_freq(self, id_freq):
        if id_freq is None:
            return None
        freq = torch.as_tensor(id_freq)
        if freq.shape != (self.num_embeddings,) or freq.is_floating_point():
            raise ValueError(f"id_freq must be an integer tensor of shape ({self.num_embeddings},), "
                             f"got {freq.dtype} {tuple(freq.shape)}")
        if bool((freq < 0).any()):
            raise ValueError("id_freq must be non-negative counts")
        return freq.to(torch.int64).cpu()

    def _host_table(self, weight, dtype) -> torch.Tensor:
        """The full table in host memory, built in place: no transient second copy."""
        if weight is not None:
            weight = weight.detach()
            if weight.device.type == "cpu" and weight.dtype == dtype and weight.is_contiguous() and (
                    weight.is_pinned() or not torch.cuda.is_available()):
                return weight
            host = pinned_empty(tuple(weight.shape), dtype)
            host.copy_(weight)
            return host
        host = pinned_empty((self.num_embeddings, self.embedding_dim), dtype)
        host.normal_()  # nn.EmbeddingBag's init
        if self.padding_idx is not None:
            host[self.padding_idx].zero_()
        return host

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, mode="mean", sparse=False, include_last_offset=False,
                        padding_idx=None, **cache_kwargs) -> "CachedEmbeddingBag":
        """As nn.EmbeddingBag.from_pretrained: rows keep their order; `freeze` means no updates."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D (rows, dim), got shape {tuple(embeddings.shape)}")
        if freeze and cache_kwargs.get("optimizer") is not None:
            raise ValueError("freeze=True with an optimizer: pass freeze=False to train the embeddings")
        rows, dim = embeddings.shape
        module = cls(rows, dim, max_norm=max_norm, norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq,
                     mode=mode, sparse=sparse, _weight=embeddings, include_last_offset=include_last_offset,
                     padding_idx=padding_idx, **cache_kwargs)
        if freeze:
            module.cache_weight.requires_grad_(False)
        return module

    # ----------------------------------------------------------------- forward
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "max" and self.sparse:
            raise ValueError("max mode does not support sparse weights (as nn.EmbeddingBag): use sparse=False")
        bags = normalize_bag_input(input, offsets, per_sample_weights, mode=self.mode,
                                   include_last_offset=self.include_last_offset,
                                   num_embeddings=self.num_embeddings, device=self.cache.device,
                                   validate=self.validate_inputs, padding_idx=self.padding_idx,
                                   table_dtype=self.cache.dtype)
        if bags.invalid_ids is not None:
            self.cache.bump_stats(invalid_ids=bags.invalid_ids, invalid_offsets=bags.invalid_offsets)
        train = torch.is_grad_enabled()
        grad_rows = train and self.optimizer is None and self.cache_weight.requires_grad
        plan = self.cache.prepare(bags.ids, bags.pad_id, train=train and self.training, grad_rows=grad_rows)
        if grad_rows:
            self.cache.mark_dirty(plan)
        rows = self.cache_weight
        anchor = self._anchor if (train and self.optimizer is not None) else None
        psw = bags.per_sample_weights
        return _PooledLookup.apply(self, plan, bags, rows, psw, anchor)

    def _rows_grad(self, plan: BatchPlan, bags: BagInput, grad_out, psw, max_pos) -> torch.Tensor:
        """Gradient of `cache_weight` (optimizer=None mode). Reads the unique count on the host (one sync on
        CUDA), so the per-unique gradient is [distinct ids, D], never [lookups, D]."""
        rows = self.cache.rows
        n = int(plan.n_uniq)
        grad_u = kernels.bag_backward(grad_out, plan.inverse, bags.offsets, bags.mode, psw, max_pos, n_rows=n)
        idx = plan.loc_u[:n]
        values = grad_u[:n].to(rows.dtype)
        if self.sparse:
            return torch.sparse_coo_tensor(idx.unsqueeze(0), values, rows.shape, check_invariants=False).coalesce()
        return torch.zeros_like(rows).index_add_(0, idx, values)

    def prefetch_targets(self, batch) -> list[tuple[EmbeddingCache, torch.Tensor]]:
        """The ids this module will look up for `batch`: a tensor of ids, an (input, offsets, ...) tuple, or a
        dict with "input". Used by cachedemb.prefetch."""
        if isinstance(batch, dict):
            batch = batch["input"]
        elif isinstance(batch, (tuple, list)):
            batch = batch[0]
        if not torch.is_tensor(batch):
            raise TypeError(f"cannot find ids in a {type(batch).__name__}: give prefetch(ids=...)")
        ids = batch.reshape(-1)
        keep = (ids >= 0) & (ids < self.num_embeddings)
        if self.padding_idx is not None:
            keep &= ids != self.padding_idx
        return [(self.cache, ids[keep])]

    # ----------------------------------------------------------------- table access
    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host table."""
        self.cache.flush()

    @property
    def weight(self) -> torch.Tensor:
        """The full table in id order (host memory; reading it flushes the cache first)."""
        self.cache.flush()
        return self.cache.host_weight

    def to_embedding_bag(self, device=None) -> nn.EmbeddingBag:
        """A plain nn.EmbeddingBag with a copy of the full table (for serving or export); needs the table to
        fit where it goes."""
        weight = self.weight.detach().to(device=device or "cpu", copy=True)
        return nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode=self.mode, sparse=self.sparse,
                                               include_last_offset=self.include_last_offset,
                                               padding_idx=self.padding_idx)

    def cache_stats(self) -> dict:
        """Counters since the last reset (a host sync on CUDA): lookups, unique (per-batch distinct ids),
        hits + misses (= unique), evictions, rows_in (rows moved host->device, window admissions included),
        host_rows (misses served from the host table in place: no free slot), rows_out (dirty rows written back),
        windows and window_rows_in (prefetch windows), bytes_in/out, invalid_ids / invalid_offsets (unvalidated
        inputs repaired on the device), `device_bytes` (what the cache holds on its device) and `seconds` (host
        time in cache operations)."""
        stats = self.cache.stats_dict()
        stats["device_bytes"] = self.cache.device_bytes()
        stats["seconds"] = self.cache.timing_dict()
        return stats

    def cache_history(self) -> dict[str, list[int]]:
        """The same counters per batch for the last `stats_history` batches (a bounded ring buffer)."""
        return self.cache.history_dict()

    def reset_cache_stats(self) -> None:
        self.cache.reset_stats()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.cache.flush()
        destination[prefix + "weight"] = self.cache.host_weight
        if self.optimizer is not None:
            for name, state in self.cache.host_states.items():
                destination[prefix + f"optimizer.{name}"] = state
            destination[prefix + _STEP_KEY] = torch.tensor(self.optimizer_step, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        weight = state_dict[key]
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(weight.shape) != expected:
            error_msgs.append(f"size mismatch for {key}: expected {expected}, got {tuple(weight.shape)}")
            return
        states = {}
        for name, host in self.cache.host_states.items():
            skey = prefix + f"optimizer.{name}"
            if skey in state_dict:
                if tuple(state_dict[skey].shape) != tuple(host.shape):
                    error_msgs.append(f"size mismatch for {skey}: expected {tuple(host.shape)}, "
                                      f"got {tuple(state_dict[skey].shape)}")
                    return
                states[name] = state_dict[skey]
        self.cache.flush()
        self.cache.host_weight.copy_(weight)
        for name, value in states.items():
            self.cache.host_states[name].copy_(value)
        if prefix + _STEP_KEY in state_dict and self.optimizer is not None:
            self.optimizer_step = int(state_dict[prefix + _STEP_KEY])
        self.cache.reload()
        # This module has no children: every key under its prefix is its own.
        known = {key} | {prefix + f"optimizer.{n}" for n in self.cache.host_states}
        if self.optimizer is not None:
            known.add(prefix + _STEP_KEY)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known)

    def _apply(self, fn, recurse=True):
        """`.to()/.cuda()/.cpu()` move the cache only; the host table never goes to the device."""
        probe = fn(torch.zeros(1, dtype=self.cache.dtype, device=self.cache.device))
        if probe.dtype != self.cache.dtype:
            raise NotImplementedError(
                f"CachedEmbeddingBag cannot change dtype ({self.cache.dtype} -> {probe.dtype}); construct it "
                "with the dtype you want")
        self.cache.move_to(probe.device)
        self.cache_weight = self.cache.rows
        return self

    def extra_repr(self) -> str:
        parts = [f"{self.num_embeddings}, {self.embedding_dim}", f"mode={self.mode!r}",
                 f"cache_rows={self.cache.capacity}", f"device={self.cache.device}"]
        if self.padding_idx is not None:
            parts.append(f"padding_idx={self.padding_idx}")
        if self.include_last_offset:
            parts.append("include_last_offset=True")
        if self.optimizer is not None:
            parts.append(f"optimizer={self.optimizer}")
        return ", ".join(parts)
