"""Batches from a preprocessed split, read straight from its memory-mapped arrays.

Batches are contiguous row ranges (one sequential read each); shuffling permutes the
order of batches, not rows, which keeps reads sequential while still decorrelating
consecutive steps. ``start_batch`` skips into that order so a resumed run sees exactly
the batches an uninterrupted one would have.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch

from .preprocess import SPLITS, load_metadata

__all__ = ["Batch", "PreprocessedSplit", "iter_batches"]


class Batch(NamedTuple):
    dense: torch.Tensor  # float32 [B, num_dense]
    sparse: torch.Tensor  # int64 [B, num_cat]
    labels: torch.Tensor  # float32 [B]


def _load(path: Path, dtype, ndim: int) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found; expected output of preprocess_files")
    # Copy-on-write mapping: torch.from_numpy needs a writable array, and a model that
    # writes into a batch in place must never change the file.
    arr = np.load(path, mmap_mode="c")
    if arr.dtype != dtype or arr.ndim != ndim:
        raise ValueError(f"{str(path)!r}: dtype {arr.dtype}, {arr.ndim}-d; expected {np.dtype(dtype)}, {ndim}-d")
    return arr


class PreprocessedSplit:
    """One split (``train``/``val``/``test``) of a preprocessed directory."""

    def __init__(self, data_dir: str | os.PathLike, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; expected one of {SPLITS}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.metadata = load_metadata(self.data_dir)
        self.dense = _load(self.data_dir / f"{split}_dense.npy", np.float32, 2)
        self.sparse = _load(self.data_dir / f"{split}_sparse.npy", np.int64, 2)
        self.labels = _load(self.data_dir / f"{split}_labels.npy", np.float32, 1)
        n = self.metadata["rows"][split]
        if not (self.dense.shape[0] == self.sparse.shape[0] == self.labels.shape[0] == n):
            raise ValueError(
                f"{str(self.data_dir)!r} split {split!r}: row counts dense={self.dense.shape[0]}, "
                f"sparse={self.sparse.shape[0]}, labels={self.labels.shape[0]}; metadata says {n}"
            )

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; expected >= 1")
        full, rest = divmod(self.num_rows, batch_size)
        return full + (1 if rest and not drop_last else 0)

    def batch_order(self, batch_size: int, *, drop_last: bool = False, shuffle: bool = False,
                    seed: int = 0, epoch: int = 0) -> np.ndarray:
        """Batch indices in the order they are served; a pure function of the arguments."""
        nb = self.num_batches(batch_size, drop_last)
        if not shuffle:
            return np.arange(nb)
        return np.random.default_rng([int(seed), int(epoch)]).permutation(nb)

    def batches(
        self,
        batch_size: int,
        *,
        drop_last: bool = False,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        start_batch: int = 0,
        limit_batches: int | None = None,
    ) -> Iterator[Batch]:
        """Yield :class:`Batch` es; ``start_batch`` positions into the (shuffled) order,
        ``limit_batches`` caps how many are yielded after it. Tensors share memory with
        the copy-on-write mapping (no copy until written)."""
        order = self.batch_order(batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed, epoch=epoch)
        if not (0 <= start_batch <= order.size):
            raise ValueError(f"start_batch={start_batch!r}; expected 0 <= start_batch <= {order.size} "
                             f"(batches in split {self.split!r} at batch_size={batch_size})")
        if limit_batches is not None and limit_batches < 0:
            raise ValueError(f"limit_batches={limit_batches!r}; expected None or >= 0")
        stop = order.size if limit_batches is None else min(order.size, start_batch + limit_batches)
        return self._serve(order[start_batch:stop].tolist(), batch_size)

    def _serve(self, order: list[int], batch_size: int) -> Iterator[Batch]:
        for b in order:
            lo, hi = b * batch_size, min((b + 1) * batch_size, self.num_rows)
            yield Batch(
                torch.from_numpy(self.dense[lo:hi]),
                torch.from_numpy(self.sparse[lo:hi]),
                torch.from_numpy(self.labels[lo:hi]),
            )


def iter_batches(
    data_dir: str | os.PathLike,
    split: str,
    batch_size: int,
    *,
    drop_last: bool = False,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    start_batch: int = 0,
    limit_batches: int | None = None,
) -> Iterator[Batch]:
    """Shorthand for ``PreprocessedSplit(data_dir, split).batches(...)``."""
    return PreprocessedSplit(data_dir, split).batches(
        batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed, epoch=epoch,
        start_batch=start_batch, limit_batches=limit_batches,
    )
