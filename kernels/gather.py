"""Gathers of valid positions, the way every CPU hot path here takes them."""
import torch


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[index] (along dim 0) for an index of valid non-negative positions, any shape, through
    index_select: the same values, and on CPU several times faster than advanced indexing."""
    return values.index_select(0, index.reshape(-1)).view(*index.shape, *values.shape[1:])
