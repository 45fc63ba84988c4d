"""Gradient of the pooled forward, reduced per unique id (duplicates summed once per row).

`grad_u [U, D]` fp32: row j holds the summed gradient of unique id j over all its lookups; rows past n are 0.
sum: each lookup gets grad_out[bag] * per_sample_weight; mean: grad_out[bag] / (non-padding lookups in bag);
max: element d of bag b goes to the lookup at max_pos[b, d] only. Padding lookups get nothing.
"""
from __future__ import annotations

import torch

from .pooled_forward import MODE_MAX, MODE_MEAN


def bag_of_lookup(offsets: torch.Tensor, n_lookups: int) -> torch.Tensor:
    """The bag index of each lookup ([B] int64), without a host sync (output_size is given)."""
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(bags, lengths, output_size=n_lookups)


def lookup_scale(inverse, offsets, mode: int, per_sample_weights=None) -> torch.Tensor:
    """Per-lookup factor on grad_out[bag] for sum/mean ([B] fp32; 0 for padding lookups)."""
    n_lookups = inverse.numel()
    valid = (inverse >= 0).float()
    if mode == MODE_MEAN:
        bag = bag_of_lookup(offsets, n_lookups)
        count = torch.zeros(offsets.numel() - 1, device=inverse.device).index_add_(0, bag, valid)
        return valid / count.clamp(min=1)[bag]
    if per_sample_weights is not None:
        return valid * per_sample_weights.float()
    return valid


def bag_backward_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None):
    """Reference segment reduction: returns grad_u [B, D] fp32 (capacity B = lookups)."""
    n_lookups = inverse.numel()
    dim = grad_out.shape[1]
    grad_out = grad_out.float()
    grad_u = torch.zeros(n_lookups, dim, dtype=torch.float32, device=grad_out.device)
    if mode == MODE_MAX:
        if max_pos is None:
            raise ValueError("max mode needs max_pos from the forward")
        has = max_pos >= 0
        target = inverse[max_pos.clamp(min=0)]
        has &= target >= 0
        flat = (target.clamp(min=0) * dim + torch.arange(dim, device=grad_out.device)).reshape(-1)
        grad_u.view(-1).index_add_(0, flat, torch.where(has, grad_out, 0.0).reshape(-1))
        return grad_u
    bag = bag_of_lookup(offsets, n_lookups)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights)
    contrib = grad_out[bag] * scale.unsqueeze(1)
    grad_u.index_add_(0, inverse.clamp(min=0), contrib)
    return grad_u


def per_sample_weights_grad(grad_out, rows, loc_u, inverse, offsets):
    """d loss / d per_sample_weights (sum mode): <grad_out[bag], row of the lookup>; 0 for padding lookups."""
    n_lookups = inverse.numel()
    bag = bag_of_lookup(offsets, n_lookups)
    lookup_rows = rows.index_select(0, loc_u[inverse.clamp(min=0)]).float()
    dots = (grad_out.float()[bag] * lookup_rows).sum(1)
    return torch.where(inverse >= 0, dots, 0.0)
