"""Where a single-table module finds its lookups in a batch it is handed whole (`cachedemb.prefetch` reads batches
ahead through `prefetch_targets(batch)`): one rule for every such module, dense, raw-id, file-backed or sharded.

The rule is positional, so it cannot tell two tables' ids apart in one batch: the pipeline refuses a default
extraction shared by several such modules (`reads_batch_by_position`) and asks for `ids=` instead.
"""
from __future__ import annotations

import torch


def batch_input_args(batch) -> tuple:
    """(input, offsets, per_sample_weights) of a batch: an id tensor, an (input, offsets[, per_sample_weights])
    tuple or list, or a dict with "input" (and "offsets", "per_sample_weights"). Missing parts are None."""
    if isinstance(batch, dict):
        if "input" not in batch:
            raise TypeError(f"cannot find ids in a dict batch with keys {sorted(map(str, batch))}: expected an "
                            "'input' key, or give prefetch(ids=lambda batch: [ids_for_module_0, ...])")
        args = (batch["input"], batch.get("offsets"), batch.get("per_sample_weights"))
    elif isinstance(batch, (tuple, list)):
        if not batch:
            raise TypeError(f"cannot find ids in an empty {type(batch).__name__}: expected (input, offsets, ...)")
        args = tuple(batch[:3]) + (None,) * (3 - len(batch[:3]))
    else:
        args = (batch, None, None)
    if not torch.is_tensor(args[0]):
        raise TypeError(f"cannot find ids in a {type(args[0]).__name__}: expected an id tensor, an (input, offsets"
                        "[, per_sample_weights]) tuple or a dict with 'input'; or give prefetch(ids=lambda batch: "
                        "[ids_for_module_0, ...])")
    return args


def batch_input(batch) -> torch.Tensor:
    """The id tensor of a batch (see `batch_input_args`)."""
    return batch_input_args(batch)[0]
