"""CachedEmbeddingBag: nn.EmbeddingBag's interface over a host-resident table with a device cache."""
from __future__ import annotations

import math
import sys
import warnings

import torch
from torch import nn

from cachedemb.cache.exact_device import exact_device
from cachedemb import kernels
from cachedemb.cache.embedding_cache import BatchPlan, EmbeddingCache, pinned_empty, state_dtype
from cachedemb.modules.batch_input import batch_input
from cachedemb.modules.cache_stats import warn_if_too_small
from cachedemb.modules.factory import build_dynamic, build_storage
from cachedemb.modules.errors import (
    InvalidPaddingIdxError,
    InvalidWeightDtypeError,
    InvalidWeightShapeError,
    NotScriptableError,
    StaleTableWriteError,
)
from cachedemb.modules.input_check import BagInput, integer_arg, normalize_bag_input, size_arg
from cachedemb.modules.meta_init import MetaTable, TableInit, default_device, init_rows, probe_apply
from cachedemb.optim import SparseOptimizer
from cachedemb.cache.policy import Policy
from cachedemb.cache.sync_mode import counts_on_host

_STEP_KEY = "optimizer.step"
_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _storage_users(table: torch.Tensor) -> int:
    """How many tensors (and storage objects) share the table's memory."""
    return torch._C._storage_Use_Count(table.untyped_storage()._cdata)


def _own_storage_users() -> int:
    """What `_storage_users` counts for the tensors over the table's memory that the module itself holds: the
    Parameter and the cache's `.data` alias, plus the storage object made to ask where torch counts it (3 on
    torch 2.13 / 2.15, 2 on torch 2.5). Measured once, on a tensor of the same shape of holders."""
    table = nn.Parameter(torch.zeros(1))
    alias = table.data  # noqa: F841 -- held while counting, as the cache holds its alias
    return _storage_users(table)


_OWN_STORAGE_USERS = _own_storage_users()


def _refuse_unsharded_world() -> None:
    """Under torchrun with world size > 1, an unsharded cached module would train one diverging copy of the
    table per rank (DDP does not see it: its rows are not a device Parameter). Refuse that loudly."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"CachedEmbeddingBag used in a job of {dist.get_world_size()} processes without sharding: each rank "
            "would train its own copy of the table. Shard the model with `cachedemb.distributed.shard(model)` "
            "(it places the tables and wraps the dense part in DDP).")


class _PooledLookup(torch.autograd.Function):
    """Pooled forward over cache rows; backward either applies the fused optimizer in place (and returns no
    gradient for the table) or returns the table's gradient in id space (optimizer=None)."""

    @staticmethod
    def forward(ctx, owner, plan: BatchPlan, bags: BagInput, weight, psw, anchor):
        cache = owner.cache
        # the fused backward reads each lookup's bag (and a mean each bag's size) as the forward records them
        record = plan.bag is not None and owner.optimizer is not None and anchor is not None
        count = None
        if record and bags.mode == kernels.MODE_MEAN:
            count = torch.empty(bags.offsets.numel() - 1, dtype=kernels.acc_dtype(cache.dtype), device=cache.device)
        out, max_pos = kernels.pooled_forward(cache.rows, plan.loc_u, plan.inverse, bags.offsets, bags.mode, psw,
                                              cache.host_weight, bag_out=plan.bag if record else None,
                                              count_out=count, spare=cache.rows_spare)
        ctx.owner, ctx.plan, ctx.bags, ctx.max_pos = owner, plan, bags, max_pos
        ctx.recorded, ctx.bag_count = record, count
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
        fused = owner.optimizer is not None
        if fused and plan.generation != cache.generation:
            raise RuntimeError(
                "CachedEmbeddingBag: backward of a batch whose cache rows were moved by a later forward or "
                f"prefetch admission (batch generation {plan.generation}, cache generation {cache.generation}). "
                "Run backward before the next forward of the same module (and before asking a prefetch "
                "pipeline for the next batch)."
            )
        grad_out = grad_out.contiguous()
        fused_phantoms = fused and ctx.recorded and not (psw is not None and ctx.needs_input_grad[4])
        if (bags.lead or bags.trail) and not fused_phantoms:
            dim = grad_out.shape[1]
            grad_out = torch.cat([grad_out.new_zeros(bags.lead, dim), grad_out, grad_out.new_zeros(bags.trail, dim)])
        grad_psw = None
        if psw is not None and ctx.needs_input_grad[4]:
            # With optimizer=None the host table is the truth and cache slots may have moved since the
            # forward (backward may follow later forwards, as autograd allows): read every row on the host.
            loc = plan.loc_u if fused else torch.where(plan.uniq >= 0, kernels.host_loc(plan.uniq), -1)
            grad_psw = kernels.per_sample_weights_grad(grad_out, cache.rows, loc, plan.inverse, bags.offsets,
                                                       cache.host_weight)
            grad_psw = grad_psw.to(psw.dtype)
        psw_values = psw.detach().reshape(-1) if psw is not None else None
        grad_scale = owner._grad_scale(plan)
        grad_weight = None
        if fused:
            owner.optimizer_step += 1
            rule = owner.optimizer.rule(owner.optimizer_step)
            names = list(cache.host_states)
            extra = {"grad_scale_u": grad_scale} if grad_scale is not None else {}
            if ctx.recorded:
                extra.update(bag=plan.bag, bag_count=ctx.bag_count, dirty=cache.dirty)
            if fused_phantoms:
                extra.update(grad_lead=bags.lead, grad_trail=bags.trail)
            kernels.backward_update(cache.rows, [cache.states[k] for k in names], plan.loc_u, plan.n_uniq, grad_out,
                                    plan.inverse, bags.offsets, bags.mode, psw_values, ctx.max_pos, rule,
                                    cache.host_weight, [cache.host_states[k] for k in names], groups=plan.groups,
                                    **extra)
            cache.mark_dirty(plan, marked=ctx.recorded)
            if owner._watched:
                cache.write_through(plan)
        elif ctx.needs_input_grad[3]:
            grad_weight = owner._weight_grad(plan, bags, grad_out, psw_values, ctx.max_pos, grad_scale)
        return None, None, None, grad_weight, grad_psw, None


class CachedEmbeddingBag(nn.Module):
    """A drop-in `nn.EmbeddingBag` whose full table (and every row's optimizer state) lives in host memory,
    pinned when CUDA exists, while a device cache holds `cache_rows` (default `cache_ratio` of the rows).

    Results equal `nn.EmbeddingBag` on the full table for every mode and input form, at any cache size:
    misses that find no free slot are served from the host table in place.

    Two ways to train:

    * `optimizer=` one of `cachedemb.optim` (the fast path): the touched rows and their per-id state are
      updated inside backward (fused, one step per backward), in the cache, written back on eviction. Training
      equals full-table training with the same optimizer.
    * `optimizer=None` (nn.EmbeddingBag's way): `weight` is the module's Parameter — the host table itself —
      and backward leaves its gradient in id space in `weight.grad`: with `sparse=True` nn.EmbeddingBag's own
      sparse COO gradient (a row per lookup), else a dense [num_embeddings, dim] host tensor (a full-table buffer
      and a pass over it per step: use sparse=True for large tables). Any torch optimizer over `parameters()`
      then trains exactly as with nn.EmbeddingBag, its state per id. Every forward that records a gradient
      re-reads the batch's rows from the host table, so the table stays the single truth.

    `weight` behaves as nn.EmbeddingBag's: reading `m.weight` writes cached updates back first, and in-place
    writes through it (also via `.data`, `nn.init`) are seen by the next forward; `m.weight = nn.Parameter(t)`
    replaces the table. A reference to the table kept across steps (even written through `.data`) is safe:
    while one lives, steps write their rows through to the host (a one-time warning names the cost).

    `device="meta"` (or `with torch.device("meta")`) allocates nothing: forward and state_dict give shapes;
    `to_empty(device=...)` then `reset_parameters()` (or `cachedemb.materialize(model)`) build the table with
    the values the module built on a device has, and `cachedemb.distributed.shard` builds only each rank's rows.

    Only training forwards count lookups for the LFU eviction; `count_in_eval=True` makes every forward count,
    so an inference-only (eval, no_grad) cache adapts to the traffic it serves.

    Example (mode="sum")::

        >>> emb = CachedEmbeddingBag(10, 3, mode="sum", cache_rows=2)
        >>> input = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])   # 8 ids
        >>> offsets = torch.tensor([0, 4])                    # bag 0 = ids[0:4], bag 1 = ids[4:8]
        >>> emb(input, offsets).shape                          # 2 bags, 4 distinct rows each > 2 cached rows
        torch.Size([2, 3])
    """

    # prefetch_targets(batch) takes the batch's input by position (modules/batch_input.py): cachedemb.prefetch
    # refuses a default extraction shared by several such modules.
    reads_batch_by_position = True

    def __new__(cls, *args, dynamic=None, storage=None, **kwargs):
        # CachedEmbeddingBag(None, dim, ..., dynamic=DynamicIds(...)) builds the raw-id module cachedemb.dynamic
        # registers (modules/factory.py), and CachedEmbeddingBag(..., storage=FileStorage(...)) the file-backed
        # one of cachedemb.storage: not instances of cls, so Python skips __init__.
        if dynamic is not None:
            if storage is not None:
                raise ValueError("dynamic= and storage= cannot be combined: a raw-id table's slab is not on file")
            return build_dynamic(*args, dynamic=dynamic, **kwargs)
        if storage is not None:
            device = kwargs.get("device", args[10] if len(args) > 10 else None)
            if cls._resolve_device(device).type != "meta":
                return build_storage(*args, storage=storage, **kwargs)
            # On meta: a plain meta module that remembers its storage; cachedemb.distributed.shard() creates each
            # rank's file of its rows (drawn as one process would draw them).
        return super().__new__(cls)

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = False, _weight: torch.Tensor | None = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device=None, dtype=None, *, _freeze: bool = False, cache_ratio: float = 0.01, cache_rows: int | None = None, optimizer: SparseOptimizer | None = None,
                 id_freq: torch.Tensor | None = None, warmup_ratio: float = 0.7, policy: str | Policy = "lfu",
                 validate_inputs: bool = True, stats_history: int = 0, freq_halflife: int | None = None,
                 count_in_eval: bool = False, dynamic=None, storage=None, _init: TableInit | None = None):
        super().__init__()
        num_embeddings = size_arg("num_embeddings", num_embeddings)
        embedding_dim = size_arg("embedding_dim", embedding_dim)
        if cache_rows is not None:
            cache_rows = integer_arg("cache_rows", cache_rows)
        self._check_args(num_embeddings, embedding_dim, max_norm, norm_type, mode, cache_ratio, cache_rows,
                         optimizer, warmup_ratio, _weight)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, norm_type, bool(scale_grad_by_freq)
        self.mode, self.sparse, self.include_last_offset = mode, sparse, include_last_offset
        self.padding_idx = self._check_padding_idx(padding_idx)
        self.optimizer, self.optimizer_step = optimizer, 0
        self.validate_inputs = validate_inputs
        self.file_storage = storage  # only on meta (else __new__ built the file-backed module): shard() makes the
        # file of each rank's rows there
        # An inference-only module (eval, no_grad) still counts its lookups, so a serving cache's LFU learns
        # the traffic it sees; by default only training forwards count (eval batches do not skew training).
        self.count_in_eval = bool(count_in_eval)
        dtype = dtype or (_weight.dtype if _weight is not None else torch.get_default_dtype())
        if dtype not in _TABLE_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, _TABLE_DTYPES))}, got {dtype}")
        device = self._resolve_device(device)
        capacity = self.cache_capacity(num_embeddings, cache_ratio, cache_rows)
        freq = self._check_id_freq(id_freq)
        self._requires_grad = optimizer is None and not _freeze
        # Fused mode: a zero-size tensor that requires grad makes autograd call our backward.
        self._anchor = torch.zeros(0, requires_grad=True, device="cpu")
        init = _init or TableInit.normal(self.padding_idx)
        if device.type == "meta":
            # Nothing allocated: to_empty()/reset_parameters(), cachedemb.materialize or shard() builds the table
            # (shard() only each rank's rows, drawn as one process would have drawn them).
            self.cache = MetaTable(self.num_embeddings, self.embedding_dim, dtype, capacity, policy, freq,
                                   stats_history, freq_halflife, warmup_ratio, init)
            self._set_table(nn.Parameter(torch.empty((self.num_embeddings, self.embedding_dim), dtype=dtype,
                                                     device="meta"), requires_grad=self._requires_grad))
            return
        self._build(self._host_table(_weight, dtype, init, device), device, capacity, policy, freq, stats_history,
                    freq_halflife, warmup_ratio)
        self._init = init

    def _build(self, host: torch.Tensor, device: torch.device, capacity: int, policy, freq, history, freq_halflife,
               warmup_ratio) -> None:
        """The table (`host`, in host memory) and its device cache."""
        table = nn.Parameter(host, requires_grad=self._requires_grad)
        state_layout = self.optimizer.state_layout(self.embedding_dim) if self.optimizer is not None else {}
        # The cache writes the table through its own alias (`.data`: a separate version counter), so the
        # Parameter's version moves only when the user (or a torch optimizer) writes it.
        self.cache = EmbeddingCache(table.data, capacity, device, state_layout, policy, freq, history=history,
                                    freq_halflife=freq_halflife)
        self._set_table(table)
        if freq is not None and warmup_ratio > 0:
            hottest = min(int(warmup_ratio * capacity), self.num_embeddings)
            if hottest > 0:
                self.cache.preload(torch.topk(freq, hottest, sorted=True).indices.sort().values)

    @staticmethod
    def cache_capacity(num_rows: int, cache_ratio: float, cache_rows: int | None) -> int:
        """Cache rows for a table of `num_rows`: `cache_rows`, else `cache_ratio` of the rows; 1 to num_rows."""
        capacity = int(cache_rows) if cache_rows is not None else math.ceil(cache_ratio * num_rows)
        return max(1, min(capacity, num_rows))

    @staticmethod
    def _resolve_device(device) -> torch.device:
        """An explicit device, else `meta` under `with torch.device("meta")`, else CUDA when there is one."""
        if device is not None:
            return exact_device(device)
        default = default_device()
        if default.type == "meta":
            return default
        return exact_device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    @property
    def is_meta(self) -> bool:
        """Built on the meta device and not materialized yet: no table, no cache."""
        return isinstance(self.cache, MetaTable)

    def reset_parameters(self) -> None:
        """Redraw the table as the constructor did (nn.EmbeddingBag's N(0, 1), padding row zeroed; a
        collection's table: its init_fn); optimizer state is left as it is. Nothing to draw on meta."""
        if self.is_meta:
            return
        self.adopt_rebound_table()
        self.cache.flush()
        init_rows(self._init, self.num_embeddings, self.embedding_dim, self.cache.dtype, 0, self.num_embeddings,
                  out=self.cache.host_weight)
        self.cache.reload()

    # ----------------------------------------------------------------- construction helpers
    @staticmethod
    def _check_args(num_embeddings, embedding_dim, max_norm, norm_type, mode, cache_ratio, cache_rows, optimizer,
                    warmup_ratio, weight):
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive number or None, got {max_norm!r}")
        if not isinstance(norm_type, (int, float)) or isinstance(norm_type, bool):
            raise ValueError(f"norm_type must be a number, got {norm_type!r}")
        if mode not in kernels.MODES:
            raise ValueError(f"mode must be one of {sorted(kernels.MODES)}, got {mode!r}")
        if cache_rows is None and not (isinstance(cache_ratio, (int, float)) and 0 < cache_ratio <= 1):
            raise ValueError(f"cache_ratio must be in (0, 1], got {cache_ratio!r}")
        if cache_rows is not None and cache_rows < 1:
            raise ValueError(f"cache_rows must be a positive int, got {cache_rows!r}")
        if optimizer is not None and not isinstance(optimizer, SparseOptimizer):
            raise TypeError(f"optimizer must be a cachedemb.optim spec (SGD, Adagrad, RowWiseAdagrad, Adam) or "
                            f"None, got {type(optimizer).__name__}; torch.optim optimizers go on parameters()")
        if not 0 <= warmup_ratio <= 1:
            raise ValueError(f"warmup_ratio must be in [0, 1], got {warmup_ratio!r}")
        if weight is not None and tuple(weight.shape) != (num_embeddings, embedding_dim):
            raise InvalidWeightShapeError(f"Shape of weight does not match num_embeddings and embedding_dim: "
                                          f"_weight must have shape ({num_embeddings}, {embedding_dim}), "
                                          f"got {tuple(weight.shape)}")

    def _check_padding_idx(self, padding_idx):
        if padding_idx is None:
            return None
        padding_idx = integer_arg("padding_idx", padding_idx)
        n = self.num_embeddings
        if not -n <= padding_idx < n:
            raise InvalidPaddingIdxError(f"padding_idx must be within num_embeddings: [-{n}, {n}), "
                                         f"got {padding_idx}")
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

    def _host_table(self, weight, dtype, init: TableInit | None = None, device=None) -> torch.Tensor:
        """The full table in host memory, built in place: no transient second copy. A given CPU table is used
        as it is (shared, as nn.EmbeddingBag shares `_weight`) unless a CUDA cache must read it pinned."""
        if weight is not None:
            weight = weight.detach()
            cuda_reads = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
            if weight.device.type == "cpu" and weight.dtype == dtype and weight.is_contiguous() and (
                    weight.is_pinned() or not cuda_reads):
                return weight
            host = pinned_empty(tuple(weight.shape), dtype)
            host.copy_(weight)
            return host
        host = pinned_empty((self.num_embeddings, self.embedding_dim), dtype)
        return init_rows(init, self.num_embeddings, self.embedding_dim, dtype, 0, self.num_embeddings, out=host)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, mode="mean", sparse=False, include_last_offset=False,
                        padding_idx=None, **cache_kwargs) -> "CachedEmbeddingBag":
        """As nn.EmbeddingBag.from_pretrained: rows keep their order; `freeze` means no updates."""
        if embeddings.dim() != 2:
            raise InvalidWeightShapeError(f"Embeddings parameter is expected to be 2-dimensional, got shape "
                                          f"{tuple(embeddings.shape)}")
        if freeze and cache_kwargs.get("optimizer") is not None:
            raise ValueError("freeze=True with an optimizer: pass freeze=False to train the embeddings")
        rows, dim = embeddings.shape
        return cls(rows, dim, max_norm=max_norm, norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq,
                   mode=mode, sparse=sparse, _weight=embeddings, include_last_offset=include_last_offset,
                   padding_idx=padding_idx, _freeze=freeze, **cache_kwargs)

    # ----------------------------------------------------------------- forward
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "max" and self.sparse:
            raise ValueError("max mode does not support sparse weights (as nn.EmbeddingBag): use sparse=False")
        if self.mode == "max" and self.scale_grad_by_freq:
            raise ValueError("max mode does not support scaling the gradient by the frequency "
                             "(as nn.EmbeddingBag): use scale_grad_by_freq=False")
        if self.is_meta:  # shapes only, as nn.EmbeddingBag on meta
            return nn.functional.embedding_bag(
                input, self._table, offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.mode,
                self.sparse, per_sample_weights, self.include_last_offset, self.padding_idx)
        if self.num_embeddings == 0 or self.embedding_dim == 0:  # an empty table (nn allows one): no rows to cache
            return nn.functional.embedding_bag(
                input, self._table.to(input.device), offsets, self.max_norm, self.norm_type,
                self.scale_grad_by_freq, self.mode, self.sparse, per_sample_weights, self.include_last_offset,
                self.padding_idx)
        if not getattr(self, "_shard_local", False):
            _refuse_unsharded_world()
        self.adopt_rebound_table()
        cache = self.cache
        bags = normalize_bag_input(input, offsets, per_sample_weights, mode=self.mode,
                                   include_last_offset=self.include_last_offset,
                                   num_embeddings=self.num_embeddings, device=cache.device,
                                   validate=self.validate_inputs, padding_idx=self.padding_idx,
                                   table_dtype=cache.dtype, count_into=cache.invalid_counts())
        watched = self._table_shared()
        table = self._table
        train = torch.is_grad_enabled()
        weight_grad = train and self.optimizer is None and table.requires_grad
        self._see_table_writes(refresh_later=weight_grad, watched=watched)
        if bags.invalid_ids is not None:
            cache.bump_stats(invalid_ids=bags.invalid_ids, invalid_offsets=bags.invalid_offsets)
        plan = cache.prepare(bags.ids, bags.pad_id, train=(train and self.training) or self.count_in_eval)
        if not getattr(self, "_warned_small_cache", False):
            warn_if_too_small(self, plan)
        if weight_grad or watched:
            cache.refresh(plan)
        if self.max_norm is not None:
            self._renorm(plan)
        anchor = self._anchor if (train and self.optimizer is not None) else None
        out = _PooledLookup.apply(self, plan, bags, table if weight_grad else None, bags.per_sample_weights,
                                  anchor)
        if bags.last_bag_scale is not None and out.shape[0] > 0:
            factor = torch.ones(out.shape[0], 1, dtype=torch.float64, device=out.device)
            factor[-1] = bags.last_bag_scale
            out = out * factor.to(out.dtype)
        return out

    def _table_shared(self) -> bool:
        """Whether anyone outside the module holds the table: the Parameter object (`w = m.weight`) or a tensor
        over its memory (`m.weight.data`, a state_dict entry, the tensor given to from_pretrained). Writes
        through `.data` move no version counter, so while such a holder lives every forward re-reads its rows
        from the host and (fused) every step writes its rows straight back (`_watched`): O(batch), no write can
        be lost. Counted from reference counts: a host-side check, no device sync."""
        if getattr(self, "_private_table", False):  # a slab owned by a layer in front (cachedemb.storage), whose
            return False  # I/O threads touch it concurrently: nothing outside can hold it
        shared = self._held_outside()
        if shared and self.cache.copying_on_host():
            # A window's rows being moved on a host thread hold transient views of the table too: wait for them
            # and count again (only then is an extra holder someone else's).
            self.cache.settle()
            shared = self._held_outside()
        if shared and not self._watched:
            self._watched = True
            if self.optimizer is not None and not self._warned_shared:
                self._warned_shared = True
                warnings.warn(
                    "CachedEmbeddingBag: the table is held outside the module (a `weight` reference, a tensor over "
                    "its memory such as `weight.data`, a state_dict entry, or the tensor given to from_pretrained "
                    "/ _weight): while it lives, every fused step writes its rows through to the host table and "
                    "every forward re-reads them, so that writes through it are never lost. Drop the reference "
                    "(or pass a copy) for full speed.", stacklevel=5)
        return shared

    def _held_outside(self) -> bool:
        """The reference and storage-use counts of `_table_shared`, taken once."""
        own_refs = 3 if self.optimizer is None else 2  # __dict__ (+ _parameters) + getrefcount's argument
        table = self.__dict__["_table"]
        return sys.getrefcount(table) > own_refs + 1 or _storage_users(table) > _OWN_STORAGE_USERS

    def _see_table_writes(self, refresh_later: bool, watched: bool = False) -> None:
        """Make the cache agree with the host table before a forward, if the table may have been written since
        it was last read: after `weight` was handed out, or when the Parameter's version moved (an in-place
        write or a torch optimizer step). A forward that records a gradient re-reads its own rows anyway
        (`refresh_later`), which is O(batch), so only other forwards re-read every cached row. While the
        table is held outside (`watched`) the forward re-reads its rows and the cache is clean between steps;
        when the last outside holder is gone, the cache is re-read once (rows written meanwhile)."""
        table = self._table
        if watched:
            self._handed_out, self._seen_version = False, table._version
            return
        if self._watched:  # the outside holders are gone: rows not read since may be stale, none is dirty
            self._watched = False
            self.cache.reload()
            self._handed_out, self._seen_version = False, table._version
            return
        stale = self._handed_out or table._version != self._seen_version
        if not stale or refresh_later:
            return
        cache = self.cache
        if cache.maybe_dirty:
            if not self._handed_out:
                raise StaleTableWriteError(
                    "CachedEmbeddingBag: the table was written in place through a reference to `weight` taken "
                    "before fused optimizer steps whose updated rows are still in the cache; applying either "
                    "would drop the other. Call `m.flush()` to keep the optimizer's rows (then redo the write), "
                    "and take `m.weight` again right before writing: reading it writes the cache back first.")
            cache.flush()  # updates made after `weight` was handed out, by a backward already in flight
        cache.reload()
        self._handed_out = False
        self._seen_version = table._version

    def _grad_scale(self, plan: BatchPlan) -> torch.Tensor | None:
        """scale_grad_by_freq: each id's gradient divided by its number of lookups in the batch."""
        if not self.scale_grad_by_freq:
            return None
        return 1.0 / plan.counts.clamp(min=1).to(state_dtype(self.cache.dtype))

    def _renorm(self, plan: BatchPlan) -> None:
        """max_norm: rows of the batch whose norm exceeds max_norm are scaled down in place before pooling, as
        nn.EmbeddingBag does (scale max_norm / (norm + 1e-7)). O(distinct ids); no host sync. With a fused
        optimizer the cached copies are renormalized (and marked dirty) and host-served rows in place; with
        optimizer=None the host table is the truth, so its rows are renormalized and re-read into the cache."""
        cache = self.cache
        loc, n = plan.loc_u, plan.n_uniq
        positions = torch.arange(loc.numel(), device=cache.device)
        live = positions < n
        host_truth = self.optimizer is None or self._watched
        if host_truth:
            sources = [(cache.host_weight, torch.where(live, plan.uniq, -1))]
        else:
            sources = [(cache.rows, torch.where(live & (loc >= 0), loc, -1)),
                       (cache.host_weight, torch.where(live & (loc <= kernels.HOST_LOC), kernels.host_loc(loc), -1))]
        rows = torch.zeros(loc.numel(), cache.dim, dtype=cache.dtype, device=cache.device)
        for table, index in sources:
            kernels.row_copy(table, index, rows, torch.where(index >= 0, positions, -1), n)
        norm = torch.linalg.vector_norm(rows, ord=self.norm_type, dim=1)
        scale = self.max_norm / (norm.to(torch.float64) + 1e-7)
        rows *= torch.where(norm > self.max_norm, scale, 1.0).to(cache.dtype).unsqueeze(1)
        for table, index in sources:
            kernels.row_copy(rows, torch.where(index >= 0, positions, -1), table, index, n)
        if host_truth:
            cache.refresh(plan)
        else:
            cache.mark_dirty(plan)

    def _weight_grad(self, plan: BatchPlan, bags: BagInput, grad_out, psw, max_pos, grad_scale) -> torch.Tensor:
        """The table's gradient in id space (optimizer=None), on the host table's device: nn.EmbeddingBag's own
        sparse gradient (below), or a dense full-table tensor built from the per-id sums (reads the distinct-id
        count on the host: one sync on CUDA)."""
        table = self._table
        if self.sparse:
            return self._sparse_weight_grad(plan, bags, grad_out, psw, grad_scale)
        n = int(plan.n_uniq)
        extra = {"grad_scale_u": grad_scale} if grad_scale is not None else {}
        grad_u = kernels.bag_backward(grad_out, plan.inverse, bags.offsets, bags.mode, psw, max_pos, n_rows=n,
                                      groups=plan.groups, **extra)
        ids = plan.uniq[:n].to(table.device)
        values = grad_u[:n].to(device=table.device, dtype=table.dtype)
        return torch.zeros(tuple(table.shape), dtype=table.dtype, device=table.device).index_add(0, ids, values)

    def _sparse_weight_grad(self, plan: BatchPlan, bags: BagInput, grad_out, psw, grad_scale) -> torch.Tensor:
        """nn.EmbeddingBag's sparse gradient, value for value: one uncoalesced row per non-padding lookup, in
        lookup order, grad_out[bag] times (1 / bag size) for mean, times the lookup's per-sample weight. A torch
        optimizer then sees exactly what it sees with nn.EmbeddingBag (sparse SGD adds duplicates one by one:
        per-id sums would round differently), so training is bit-identical. [lookups, D] values, as nn's; the
        padding filter reads a count on the host (one sync on CUDA)."""
        table = self._table
        ids = bags.ids
        bag = kernels.bag_of_lookup(bags.offsets, ids.numel())
        values = grad_out.index_select(0, bag)
        keep = ids != bags.pad_id if bags.pad_id is not None else None
        if bags.mode == kernels.MODE_MEAN:
            live = keep.to(values.dtype) if keep is not None else torch.ones_like(ids, dtype=values.dtype)
            size = torch.zeros(bags.offsets.numel() - 1, dtype=values.dtype, device=ids.device).index_add_(0, bag, live)
            values = values * (1 / size).index_select(0, bag).unsqueeze(1)
        if psw is not None:
            values = values * psw.to(values.dtype).unsqueeze(1)
        if grad_scale is not None:  # scale_grad_by_freq (nn refuses it with sparse gradients)
            values = values * grad_scale.index_select(0, plan.inverse.clamp(min=0)).to(values.dtype).unsqueeze(1)
        if keep is not None:
            ids, values = ids[keep], values[keep]
        values = values.to(device=table.device, dtype=table.dtype)
        return torch.sparse_coo_tensor(ids.to(table.device).unsqueeze(0), values, tuple(table.shape),
                                       check_invariants=False)

    def prefetch_targets(self, batch) -> list[tuple[EmbeddingCache, torch.Tensor]]:
        """The ids this module will look up for `batch`: a tensor of ids, an (input, offsets, ...) tuple, or a
        dict with "input". Used by cachedemb.prefetch."""
        self.adopt_rebound_table()
        ids = batch_input(batch).reshape(-1)
        if ids.device.type == "cpu" and ids.numel() and self.padding_idx is None and ids.dtype in (torch.int64,
                                                                                                   torch.int32):
            lo, hi = torch.aminmax(ids)  # one pass; a masked copy costs ~10x that, and the ids are usually valid
            if int(lo) >= 0 and int(hi) < self.num_embeddings:
                return [(self.cache, ids)]
        keep = (ids >= 0) & (ids < self.num_embeddings)
        if self.padding_idx is not None:
            keep &= ids != self.padding_idx
        return [(self.cache, ids[keep])]

    # ----------------------------------------------------------------- table access
    def _set_table(self, table: nn.Parameter) -> None:
        """Make `table` the module's weight: registered as the Parameter `weight` with optimizer=None (a torch
        optimizer trains it), held aside with a fused optimizer (which trains it in the cache)."""
        object.__setattr__(self, "_table", table)
        self._handed_out, self._seen_version = False, table._version
        self._watched = getattr(self, "_watched", False)
        self._warned_shared = getattr(self, "_warned_shared", False)
        if self.optimizer is None:
            self._parameters["weight"] = table
        else:
            self._parameters.pop("weight", None)

    def __getattr__(self, name: str):
        if name == "weight" and "_table" in self.__dict__:
            return self._hand_out_table()
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight" and "_table" in self.__dict__:
            self._replace_table(value)
            return
        super().__setattr__(name, value)

    def _hand_out_table(self) -> nn.Parameter:
        """`m.weight`: the full host table in id order. Cached updates are written back first and the next
        forward re-reads the cache from the table, so whatever the caller writes into it is seen and kept."""
        if self.is_meta:
            return self._table
        self.cache.flush()
        self._handed_out = True
        return self._table

    def _replace_table(self, value) -> None:
        """`m.weight = nn.Parameter(t)`: t becomes the table (see `_adopt`)."""
        if not isinstance(value, nn.Parameter):
            raise TypeError(f"cannot assign '{torch.typename(value)}' as parameter 'weight' "
                            "(torch.nn.Parameter expected)")
        self._adopt(value)

    def adopt_rebound_table(self) -> None:
        """Adopt a table whose storage was replaced behind the module's back: `m.weight.data = t` or
        `m.weight.set_(t)` (the reference DLRM script initializes its tables with `.data = ...`) rebind the
        Parameter without telling it. O(1) per call (the Parameter's data pointer and layout against the
        cache's host table), no device sync; every entry point that reads or writes the table calls it."""
        if self.is_meta:
            return
        table, host = self.__dict__["_table"], self.cache.host_weight
        if (table.data_ptr() == host.data_ptr() and table.dtype == host.dtype and table.shape == host.shape
                and table.stride() == host.stride() and table.device == host.device):
            return
        self._adopt(table)

    def _adopt(self, param: nn.Parameter) -> None:
        """Make `param` (its current data) the table: checked first, so a table that cannot be adopted raises
        before anything changes; data that is not a contiguous host tensor (pinned where CUDA exists) is copied
        there once and `param` rebound to the copy. The old table gets the cache's pending rows and optimizer
        state (written before the replacement, as nn.EmbeddingBag's steps would have been), the optimizer state
        stays per id (as a torch optimizer's state stays with its Parameter), and every cached row is re-read."""
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(param.shape) != expected:
            raise InvalidWeightShapeError(
                f"weight must have shape {expected} (num_embeddings, embedding_dim), got {tuple(param.shape)}: a "
                "table of another shape needs a new CachedEmbeddingBag (e.g. CachedEmbeddingBag.from_pretrained)")
        if param.dtype not in _TABLE_DTYPES:
            raise InvalidWeightDtypeError(f"weight dtype must be one of {', '.join(map(str, _TABLE_DTYPES))}, "
                                          f"got {param.dtype}")
        if param.device.type == "meta":
            raise InvalidWeightShapeError("weight has no data (a meta tensor): bind a table with values")
        host = self._host_table(param, param.dtype, device=self.cache.device)
        copied = host.data_ptr() != param.data_ptr()
        if copied and _storage_users(param) > 2:  # the Parameter + the storage object asked: someone else holds it
            warnings.warn(
                "CachedEmbeddingBag: the new table was copied once into host memory the cache can read (pinned, "
                f"contiguous; it was {param.device.type}{', not pinned' if param.device.type == 'cpu' else ''}); "
                "later writes through the tensor you bound are not seen: write through `m.weight`.", stacklevel=4)
        self.cache.flush()
        if copied:
            param.data = host
        # The cache's own alias (`.data`, a separate version counter: see _build).
        self.cache.replace_host_table(param.data)
        self._set_table(param)

    def __getstate__(self):
        """Copies (copy.deepcopy, pickle, torch.save of the module) take the table with every cached update:
        the cache is written back first."""
        if not self.is_meta:
            self.adopt_rebound_table()
            self.cache.flush()
        return super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()

    def __setstate__(self, state):
        """A copy's Parameter got its own storage (Parameter.__deepcopy__ clones its data) apart from the copied
        cache's host alias: the alias is bound to the copy's table again (equal values: flushed before)."""
        super().__setstate__(state)
        table = self.__dict__["_table"]
        if not self.is_meta and self.cache.host_weight.data_ptr() != table.data_ptr():
            self.cache.host_weight = table.data
        self._handed_out, self._seen_version = False, table._version

    def _resize_rows(self, num_rows: int) -> None:
        """Make the host table `num_rows` rows, the first ones kept (cachedemb.storage's transient staging
        rows for a batch larger than its host cache). Resident rows must lie below `num_rows`."""
        self.cache.resize_host(num_rows)
        self.num_embeddings = num_rows
        self._table.data = self.cache.host_weight
        self.cache.host_weight = self._table.data  # the cache's own alias (see _build)
        self._seen_version = self._table._version

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to the host table."""
        self.adopt_rebound_table()
        self.cache.flush()

    def __prepare_scriptable__(self):
        raise NotScriptableError(
            "torch.jit.script cannot compile CachedEmbeddingBag: its device cache is Python-side state "
            "(admission, eviction, write-back to the host table) that TorchScript cannot express. Script "
            "`module.to_embedding_bag()` (an nn.EmbeddingBag holding a copy of the table) instead.")

    def to_embedding_bag(self, device=None) -> nn.EmbeddingBag:
        """A plain nn.EmbeddingBag with a copy of the full table (for serving or export); needs the table to
        fit where it goes."""
        self.adopt_rebound_table()
        self.cache.flush()
        weight = self.cache.host_weight.to(device=device or "cpu", copy=True)
        return nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode=self.mode, sparse=self.sparse,
                                               include_last_offset=self.include_last_offset,
                                               padding_idx=self.padding_idx)

    def cache_stats(self) -> dict:
        """Counters since the last reset (`reset_cache_stats`); a host sync on CUDA.

        Per batch, each distinct id looked up is a hit or a miss:

        - `lookups`: ids looked up (padding excluded); `unique`: distinct ids per batch, summed over batches.
        - `hits`: distinct ids whose row was in the device cache before the batch; `misses`: the others, so
          hits + misses = unique. A row a prefetch window moved in ahead counts as a miss of the first batch
          that looks it up (the same rows come from the host with prefetch or without, so a trace whose rows
          prefetch moves as the cache alone would gives the same hit_rate either way). Under the CUDA rules
          (a CUDA cache, or CACHEDEMB_SYNC_FREE=1) they are counted when their window ends: the same totals
          at every window boundary, and `cache_history()` gives them to the batch after the window.
        - `hit_rate`: hits / unique (nan before any lookup).
        - `window_misses`: the misses of that kind (rows a window moved in before the batch needed them).
        - `rows_in`: rows copied host -> device (batch misses admitted and window admissions); `host_rows`:
          misses served from the host table in place (no free slot: a batch larger than the cache, or a
          cache held by a prefetch window), not copied in; `rows_out`: dirty rows written back to the host;
          `evictions`: resident rows replaced. `bytes_in` / `bytes_out`: those rows' bytes (rows in carry
          their 8-byte access count too).
        - `windows`, `window_rows_in`: prefetch windows admitted and the rows they needed from the host.
        - `invalid_ids`, `invalid_offsets`: unvalidated inputs repaired on the device
          (`validate_inputs=False`).
        - `device_bytes`: what the cache holds on its device.
        - `seconds`: host seconds in cache operations (on CUDA: issuing them), by stage: `lookup` (a forward's
          cache work, including its `eviction`, `index_rebuild` and `count_halving`), `eviction` (ranking
          victims), `index_rebuild`, `count_halving` (`freq_halflife`), `flush` (write-backs), and under
          `prefetch` the pipeline's: `read`, `wait`, `window_admission` (including its `next_use_refresh`),
          `window_protect`, `row_moves_wait`, and `read_ahead` (on its thread: `unique`, `next_use`,
          `window_plan`, `next_use_query`, `forward_unique`). cachedemb.cache.counters.SECONDS maps
          them to the internal timers.
        """
        if not getattr(self, "_warned_small_cache", False) and not counts_on_host(self.cache.device):
            warn_if_too_small(self, None, stacklevel=3)
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
        if self.is_meta:  # shapes only (nn.Module's meta state_dict); optimizer state is made on materialization
            destination[prefix + "weight"] = self._table if keep_vars else self._table.detach()
            return
        self.adopt_rebound_table()
        self.cache.flush()
        destination[prefix + "weight"] = self._table if keep_vars else self._table.detach()
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
        self.adopt_rebound_table()
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
        """`.to()/.cuda()/.cpu()` move the cache only: the host table never goes to the device.
        `.to(dtype)/.half()/.double()...` convert the table (and the cache, and the optimizer state where it
        follows the table: float64 for a float64 table, else float32). From meta, `to_empty(device=...)` /
        `.to(device)` allocate the table zeroed (`reset_parameters()` draws it) and the cache on that device."""
        if self.is_meta:
            return self._materialize(fn)
        self.adopt_rebound_table()
        probe = fn(torch.zeros(1, dtype=self.cache.dtype, device=self.cache.device))
        if probe.dtype != self.cache.dtype:
            if probe.dtype not in _TABLE_DTYPES:
                raise TypeError(f"CachedEmbeddingBag tables are {', '.join(map(str, _TABLE_DTYPES))}; "
                                f"cannot convert to {probe.dtype}")
            self.cache.flush()
            converted = pinned_empty(tuple(self._table.shape), probe.dtype)
            converted.copy_(self.cache.host_weight)
            self._table.data = converted
            self.cache.replace_host_table(self._table.data)
        self.cache.move_to(probe.device)
        if self.cache.host_weight.data_ptr() != self._table.data_ptr():  # moved into pinned memory
            self._table.data = self.cache.host_weight
            self.cache.host_weight = self._table.data
        self._seen_version = self._table._version
        return self

    def _materialize(self, fn):
        spec: MetaTable = self.cache
        probe = probe_apply(fn, spec.dtype, "meta")
        if probe.dtype not in _TABLE_DTYPES:
            raise TypeError(f"CachedEmbeddingBag tables are {', '.join(map(str, _TABLE_DTYPES))}; "
                            f"cannot convert to {probe.dtype}")
        if probe.device.type == "meta":
            spec.dtype = probe.dtype
            self._table.data = torch.empty(tuple(self._table.shape), dtype=probe.dtype, device="meta")
            return self
        if self.file_storage is not None:
            raise ValueError(f"this CachedEmbeddingBag was built on meta with storage=FileStorage("
                             f"{str(self.file_storage.path)!r}, ...): its rows belong in files, not in memory. "
                             "Shard it with cachedemb.distributed.shard(model) (each rank creates the file of its "
                             "rows), or build it on a real device for one process")
        host = pinned_empty((self.num_embeddings, self.embedding_dim), probe.dtype)
        host.zero_()
        self._build(host, probe.device, spec.capacity, spec.policy, spec.id_freq, spec.history, spec.freq_halflife,
                    spec.warmup_ratio)
        self._init = spec.init
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
