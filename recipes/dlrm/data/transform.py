"""What preprocessing does to each row, shared by the serial pass (:mod:`.preprocess`) and the worker processes
(:mod:`.parallel`) so both write the same bytes: the dense transform and the per-id train counts."""

from __future__ import annotations

import numpy as np

#: torchrec's Criteo pipeline (torchrec/datasets/scripts/nvt/process_criteo_parquet.py):
#: FillMissing(0), then col + 2, then LogOp (log1p), i.e. log(x + 3). Criteo has a few
#: values below -2 where that is undefined; they are clamped to -2 (-> log 1 = 0).
#: (torchrec's in-memory ``tsv_to_npys`` instead shifts by a per-file minimum; a fixed
#: shift keeps train/val/test on one scale.)
DENSE_TRANSFORM = "log(max(x, -2) + 3), missing x = 0"


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """Apply :data:`DENSE_TRANSFORM` to raw dense values (missing already 0); float32 out."""
    return np.log(np.maximum(np.asarray(raw, dtype=np.float64), -2.0) + 3.0).astype(np.float32)


def count_into(counts: np.ndarray, ids: np.ndarray, size: int) -> None:
    """counts[ids] += multiplicity, without an O(size) temporary for huge tables."""
    if size <= 4 * ids.size:
        counts += np.bincount(ids, minlength=size)
    else:
        uniq, mult = np.unique(ids, return_counts=True)
        counts[uniq] += mult
