"""Gathers of valid positions, the way every CPU hot path here takes them."""
import torch


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[index] (along dim 0) for an index of valid non-negative positions, any shape, through
    index_select: the same values, and on CPU several times faster than advanced indexing."""
    return values.index_select(0, index.reshape(-1)).view(*index.shape, *values.shape[1:])


# dtypes numpy holds bit for bit (no bfloat16)
_BUMP = getattr(torch.autograd.graph, "increment_version", None)
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool)


def put_rows(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[index[i]] = rows[i] along dim 0, for distinct valid positions: index_copy_'s result. On CPU through
    numpy's row assignment, which copies whole rows (3-4x faster than index_copy_, which indexes element by
    element); the tensor's version is bumped as an in-place torch op would."""
    if (_BUMP is not None and dst.device.type == "cpu" and rows.device.type == "cpu" and dst.dtype == rows.dtype
            and dst.dtype in _NUMPY_DTYPES and dst.is_contiguous() and not dst.is_conj() and not dst.is_neg()):
        dst.detach().numpy()[index.detach().numpy()] = rows.detach().numpy()
        _BUMP(dst)
        return
    dst.index_copy_(0, index, rows.to(dst.dtype))
