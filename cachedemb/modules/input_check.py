"""Validation and normalization of nn.EmbeddingBag inputs, done before any cache state changes.

Every form (1-D input + offsets, include_last_offset, 2-D input) becomes flat int64 ids and `offsets` with
bags + 1 entries ending at the number of ids. Value checks (id range, offsets order) read the data: free for
host tensors; for CUDA tensors they cost one host sync, which `validate=False` skips.

Unvalidated inputs are made safe on the device instead (as FBGEMM's `bounds_check_indices`): ids out of range
become padding lookups, offsets are clamped into [0, len(input)] and made non-decreasing, and both are counted
(`invalid_ids`, `invalid_offsets` in the cache stats), so a bad batch is visible, never silent, and nothing is
read or written outside the tables. Lookups outside every bag (before offsets[0], or past offsets[-1] with
include_last_offset) are padding too: they sit in phantom bags at either end whose outputs are dropped.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from cachedemb.cache.exact_device import exact_device
from cachedemb import kernels
from cachedemb.modules.errors import (InvalidIdError, InvalidInputTypeError, InvalidOffsetsError, NegativeSizeError,
                                      NotAnIntegerError, NotATensorError, UnsupportedModeError)
from cachedemb.cache.sync_mode import counts_on_host

_ID_DTYPES = (torch.int32, torch.int64)


@dataclass
class BagInput:
    ids: torch.Tensor  # [B] int64 on the cache device
    offsets: torch.Tensor  # [bags + 1] int64, offsets[-1] == B
    mode: int
    per_sample_weights: torch.Tensor | None  # [B] on the cache device, keeps requires_grad
    psw_shape: tuple  # the caller's per_sample_weights shape, for its gradient
    pad_id: int | None = None  # the id that marks a padding lookup (padding_idx, or -1 for sanitized ids)
    lead: int = 0  # phantom bags before the caller's bags (their outputs are dropped)
    trail: int = 0  # phantom bags after them
    invalid_ids: torch.Tensor | None = None  # [1] ids turned into padding (unvalidated inputs)
    invalid_offsets: torch.Tensor | None = None  # [1] offsets clamped
    # include_last_offset with offsets[-1] < len(input), mode="mean", no padding_idx: nn.EmbeddingBag sums the
    # last bag up to offsets[-1] but divides by its lookups up to the input's end; the factor that turns our
    # mean of the last bag into that (a float, or a [1] device tensor when offsets were not read).
    last_bag_scale: float | torch.Tensor | None = None

    @property
    def num_bags(self) -> int:
        return self.offsets.numel() - 1 - self.lead - self.trail


def integer_arg(name: str, value) -> int:
    """`value` as a Python int, accepting what nn.EmbeddingBag accepts for its sizes and indices (ints, numpy
    integers, one-element integer tensors, anything with `__index__`; the reference DLRM script parses its table
    sizes with numpy) and refusing the rest with nn's exception type. bool is refused: nn refuses it as a size."""
    if torch.is_tensor(value):
        if value.numel() == 1 and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
            return int(value.item())
    elif not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise NotAnIntegerError(f"{name} must be an integer (int, numpy integer, one-element integer tensor), got "
                            f"{type(value).__name__} {value!r}")


def size_arg(name: str, value) -> int:
    """A table size (num_embeddings, embedding_dim): an integer >= 0, as nn.EmbeddingBag takes it."""
    size = integer_arg(name, value)
    if size < 0:
        raise NegativeSizeError(f"{name} must be >= 0, got {size}")
    return size


def _check_int_tensor(name: str, t) -> None:
    if not torch.is_tensor(t):
        raise NotATensorError(f"{name} must be a torch.Tensor of int32/int64, got {type(t).__name__}")
    if t.dtype not in _ID_DTYPES:
        raise InvalidInputTypeError(f"{name} must hold int32 or int64 values, got dtype {t.dtype}")


def _first_bad(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def normalize_bag_input(input, offsets, per_sample_weights, *, mode: str, include_last_offset: bool,
                        num_embeddings: int, device: torch.device, validate: bool = True,
                        padding_idx: int | None = None, table_dtype: torch.dtype | None = None,
                        count_into: torch.Tensor | None = None) -> BagInput:
    """`count_into` ([2] int64 on `device`: invalid ids, invalid offsets), where given, takes the counts of an
    unvalidated repair directly (the BagInput then carries none): the repair is one launch (kernels.bag_input)."""
    _check_int_tensor("input", input)
    check_values = validate or counts_on_host(input.device)
    if per_sample_weights is not None:
        _check_per_sample_weights(per_sample_weights, input, mode, table_dtype)
    if not check_values and count_into is not None and input.dim() in (1, 2) and \
            (input.dim() == 2) == (offsets is None) and input.device == exact_device(device):
        return _repair_on_device(input, offsets, per_sample_weights, mode, include_last_offset, num_embeddings,
                                 exact_device(device), padding_idx, count_into)
    lead = trail = 0
    bad_offsets = last_bag_scale = None
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("if input is 2-D (bags x ids per bag), offsets must be None, "
                             f"got a tensor of shape {tuple(offsets.shape)}")
        bags, width = input.shape
        ids = input.reshape(-1)
        full = torch.arange(bags + 1, device=device, dtype=torch.int64) * width
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets is required when input is 1-D (a 1-D tensor of bag starts), got None")
        _check_int_tensor("offsets", offsets)
        if offsets.dim() != 1:
            raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
        if include_last_offset and offsets.numel() == 0:
            raise InvalidOffsetsError("include_last_offset=True needs at least one offset (the end), got none")
        ids = input
        n = input.numel()
        offs = offsets.to(torch.int64)
        # include_last_offset with offsets[-1] < len(input): nn.EmbeddingBag's last bag runs to the input's end
        # with padding_idx or in max mode; otherwise it ends at offsets[-1] (a mean still divides by the lookups
        # up to the input's end). Lookups past offsets[-1] are otherwise ignored.
        extend_last = include_last_offset and offs.numel() > 1 and (padding_idx is not None or mode == "max")
        if check_values:
            if offs.numel() > 0:
                host_offs = offs.cpu()
                _check_offsets(host_offs, n)
                end = int(host_offs[-1])
                if include_last_offset and end < n:
                    if extend_last:
                        offs = torch.cat([offs[:-1], torch.full((1,), n, dtype=torch.int64)])
                    else:
                        ids = input[:end]
                        if mode == "mean" and offs.numel() > 1:
                            start = int(host_offs[-2])
                            last_bag_scale = (end - start) / (n - start)
            else:
                ids = input[:0]  # no offsets, no bags: no lookup is pooled (nor gets a gradient)
            offs = offs.to(device)
            full = offs if include_last_offset else torch.cat(
                [offs, torch.full((1,), ids.numel(), dtype=torch.int64, device=device)])
        else:
            # Device-side repair, no host read: phantom bags [0, offsets[0]) and, with include_last_offset,
            # [offsets[-1], n) hold the lookups outside every bag (made padding below).
            offs = offs.to(device)
            fixed = torch.cummax(offs.clamp(0, n), 0).values
            bad_offsets = (fixed != offs).sum().reshape(1)
            zero = torch.zeros(1, dtype=torch.int64, device=device)
            end = torch.full((1,), n, dtype=torch.int64, device=device)
            lead, trail = 1, int(include_last_offset)
            if extend_last:
                full, trail = torch.cat([zero, fixed[:-1], end]), 0
            else:
                full = torch.cat([zero, fixed, end])
                if include_last_offset and mode == "mean" and fixed.numel() > 1:
                    start = fixed[-2:-1]
                    last_bag_scale = ((fixed[-1:] - start) / (n - start).clamp(min=1)).to(torch.float64)
    else:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D shape {tuple(input.shape)}")

    psw, psw_shape = None, ()
    if per_sample_weights is not None:
        psw_shape = tuple(per_sample_weights.shape)
        psw = per_sample_weights.reshape(-1)[: ids.numel()].to(device).contiguous()

    if check_values and ids.numel() > 0:
        bad = (ids < 0) | (ids >= num_embeddings)
        if bool(bad.any()):
            i = _first_bad(bad)
            raise InvalidIdError(f"input id {int(ids.reshape(-1)[i])} at position {i} is out of range: ids must "
                                 f"be in [0, {num_embeddings})")
    ids = ids.reshape(-1).to(device=device, dtype=torch.int64).contiguous()
    full = full.contiguous()
    if check_values:
        return BagInput(ids, full, kernels.MODES[mode], psw, psw_shape, pad_id=padding_idx,
                        last_bag_scale=last_bag_scale)
    # Unvalidated: out-of-range ids and lookups outside every bag become padding, counted on the device.
    pad_id = padding_idx if padding_idx is not None else -1
    out_of_range = (ids < 0) | (ids >= num_embeddings)
    position = torch.arange(ids.numel(), device=device)
    outside = position < full[lead]
    if trail:
        outside |= position >= full[-1 - trail]
    ids = torch.where(out_of_range | outside, torch.full_like(ids, pad_id), ids)
    invalid = (out_of_range & ~outside).sum().reshape(1)
    if bad_offsets is None:
        bad_offsets = torch.zeros(1, dtype=torch.int64, device=device)
    return BagInput(ids, full, kernels.MODES[mode], psw, psw_shape, pad_id=pad_id, lead=lead, trail=trail,
                    invalid_ids=invalid, invalid_offsets=bad_offsets, last_bag_scale=last_bag_scale)


def _repair_on_device(input, offsets, per_sample_weights, mode: str, include_last_offset: bool, num_embeddings: int,
                      device: torch.device, padding_idx, count_into) -> BagInput:
    """The unvalidated path of normalize_bag_input in one launch (same BagInput; the counts go to count_into)."""
    n = input.numel()
    pad_id = padding_idx if padding_idx is not None else -1
    last_bag_scale = None
    if input.dim() == 2:
        offs, width, lead, trail, extend_last = None, input.shape[1], 0, 0, False
        n_full = input.shape[0] + 1
    else:
        _check_int_tensor("offsets", offsets)
        if offsets.dim() != 1:
            raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
        if include_last_offset and offsets.numel() == 0:
            raise InvalidOffsetsError("include_last_offset=True needs at least one offset (the end), got none")
        offs, width = offsets.to(device), 0
        extend_last = include_last_offset and offs.numel() > 1 and (padding_idx is not None or mode == "max")
        lead, trail = 1, int(include_last_offset and not extend_last)
        n_full = offs.numel() + (1 if extend_last else 2)
    buf = torch.empty(n + n_full, dtype=torch.int64, device=device)
    ids, full = buf[:n], buf[n:]
    kernels.bag_repair(input, offs, num_embeddings, pad_id, width, bool(trail), extend_last, count_into, ids, full)
    if include_last_offset and trail and mode == "mean" and offs.numel() > 1:
        start = full[-3:-2]
        last_bag_scale = ((full[-2:-1] - start) / (n - start).clamp(min=1)).to(torch.float64)
    psw, psw_shape = None, ()
    if per_sample_weights is not None:
        psw_shape = tuple(per_sample_weights.shape)
        psw = per_sample_weights.reshape(-1)[:n].to(device).contiguous()
    return BagInput(ids, full, kernels.MODES[mode], psw, psw_shape, pad_id=pad_id, lead=lead, trail=trail,
                    last_bag_scale=last_bag_scale)


def _check_per_sample_weights(per_sample_weights, input, mode: str, table_dtype=None) -> None:
    if not torch.is_tensor(per_sample_weights) or not per_sample_weights.is_floating_point():
        raise InvalidInputTypeError("per_sample_weights must be a floating-point tensor, got "
                                    f"{getattr(per_sample_weights, 'dtype', type(per_sample_weights).__name__)}")
    if table_dtype is not None and per_sample_weights.dtype != table_dtype:
        raise InvalidInputTypeError(f"per_sample_weights ({per_sample_weights.dtype}) must have the same type as "
                                    f"the table's weight ({table_dtype}), as in nn.EmbeddingBag")
    if mode != "sum":
        raise UnsupportedModeError(f"per_sample_weights is only supported for mode='sum', got mode={mode!r}")
    if tuple(per_sample_weights.shape) != tuple(input.shape):
        raise ValueError(f"per_sample_weights must have the same shape as the input: shape {tuple(input.shape)}, "
                         f"got {tuple(per_sample_weights.shape)}")


def _check_offsets(host: torch.Tensor, n: int) -> None:
    if int(host[0]) != 0:
        raise InvalidOffsetsError(f"offsets[0] must be 0 (the first bag starts at position 0), got {int(host[0])}")
    steps = host[1:] - host[:-1]
    if bool((steps < 0).any()):
        i = _first_bad(steps < 0)
        raise InvalidOffsetsError(f"offsets must be non-decreasing, got offsets[{i}]={int(host[i])} > "
                                  f"offsets[{i + 1}]={int(host[i + 1])}")
    if int(host[-1]) > n:
        raise InvalidOffsetsError(f"offsets[-1] must be <= len(input)={n}, got {int(host[-1])}")
