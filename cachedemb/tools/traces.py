"""Id traces for cache simulation: synthetic Zipf and Criteo-like traces, and user files.

Why: cache policies are compared by replaying the same trace through each of them, so traces
must be reproducible (seeded), realistic in skew (power-law popularity with hot ids scattered
over the id space, not packed at 0..k), and loadable from recorded production lookups.

A trace is a list of 1-D int64 numpy arrays, one per batch, duplicates allowed.
"""

from __future__ import annotations

import math
import os
import re
from typing import Sequence

import numpy as np

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "criteo_like_trace",
    "criteo_table_sizes",
    "load_trace",
    "save_trace",
    "table_offsets",
    "zipf_trace",
]

#: Cardinalities of the 26 categorical features of the Criteo Kaggle (Display Advertising) data.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)

# Ranks up to this many get exact cumulative weights; beyond, the tail is integrated.
_EXACT_HEAD = 1 << 20


class _ZipfSampler:
    """Inverse-CDF sampler of ranks 0..n-1 with P(rank r) proportional to (r+1)^-alpha.

    Works for any alpha >= 0 (numpy's zipf needs alpha > 1 and is unbounded).  The first
    ``head`` ranks use exact float64 cumulative weights; the rest use the midpoint-rule integral
    of x^-alpha, whose error is negligible that far out, so memory stays O(head) for any n.
    """

    def __init__(self, n: int, alpha: float, head: int = _EXACT_HEAD):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"number of rows must be a positive integer, got {n!r}")
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        self.n, self.alpha = int(n), alpha
        self.head = min(self.n, int(head))
        self.cdf = np.cumsum(np.arange(1, self.head + 1, dtype=np.float64) ** -alpha)
        self.head_mass = float(self.cdf[-1])
        self.a = self.head + 0.5  # tail rank k covers [k - 0.5, k + 0.5)
        self.tail_mass = self._integral(self.n + 0.5) if self.n > self.head else 0.0

    def _integral(self, x):
        """Integral of t^-alpha from ``self.a`` to ``x``."""
        e = 1.0 - self.alpha
        if abs(e) < 1e-12:
            return np.log(x / self.a)
        return (np.power(x, e) - self.a**e) / e

    def _inverse(self, v):
        """``x`` with ``_integral(x) == v``."""
        e = 1.0 - self.alpha
        if abs(e) < 1e-12:
            return self.a * np.exp(v)
        return np.power(np.maximum(self.a**e + e * v, np.finfo(np.float64).tiny), 1.0 / e)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        u = rng.random(size) * (self.head_mass + self.tail_mass)
        ranks = np.minimum(np.searchsorted(self.cdf, u, side="right"), self.head - 1).astype(np.int64)
        in_tail = u >= self.head_mass
        if in_tail.any():
            x = self._inverse(u[in_tail] - self.head_mass)
            ranks[in_tail] = np.clip(np.floor(x + 0.5), self.head + 1, self.n).astype(np.int64) - 1
        return ranks


class _RandomBijection:
    """A seeded pseudo-random permutation of 0..n-1 evaluated pointwise, in O(1) memory.

    Why: ``rng.permutation(20_000_000)`` costs 160 MB; instead each round (xor a constant,
    multiply by an odd constant, xorshift) is a bijection on b-bit words, and cycle-walking
    restricts the composition to [0, n) while keeping it a bijection.
    """

    _ROUNDS = 4

    def __init__(self, n: int, rng: np.random.Generator):
        self.n = int(n)
        self.bits = max(1, (self.n - 1).bit_length())
        self.mask = np.uint64((1 << self.bits) - 1)
        self.shift = np.uint64(max(1, self.bits // 2))
        hi = 1 << self.bits
        self.xors = [np.uint64(int(rng.integers(0, hi, dtype=np.uint64))) for _ in range(self._ROUNDS)]
        self.mults = [np.uint64(int(rng.integers(0, hi, dtype=np.uint64)) | 1) for _ in range(self._ROUNDS)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            for c, m in zip(self.xors, self.mults):
                x = x ^ c
                x = (x * m) & self.mask
                x = x ^ (x >> self.shift)
        return x

    def __call__(self, ranks: np.ndarray) -> np.ndarray:
        x = self._round_trip(np.asarray(ranks, dtype=np.int64).astype(np.uint64))
        out = x >= np.uint64(self.n)
        while out.any():  # cycle-walk back into [0, n); expected < 2 extra rounds
            idx = np.flatnonzero(out)
            x[idx] = self._round_trip(x[idx])
            out[idx] = x[idx] >= np.uint64(self.n)
        return x.astype(np.int64)


def _check_count(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def zipf_trace(
    num_rows: int,
    batch_lookups: int,
    num_batches: int,
    alpha: float,
    seed: int = 0,
    permute: bool = True,
) -> list[np.ndarray]:
    """Batches of ``batch_lookups`` ids drawn i.i.d. from Zipf(alpha) over ``num_rows`` rows.

    Rank r (1-based) has probability proportional to r^-alpha; alpha may be <= 1 (0 is uniform).
    With ``permute`` ranks go through a fixed seeded permutation of the id space, so hot ids
    are scattered; without it rank r is id r-1.
    """
    num_rows = _check_count("num_rows", num_rows, 1)
    batch_lookups = _check_count("batch_lookups", batch_lookups, 1)
    num_batches = _check_count("num_batches", num_batches, 0)
    rng = np.random.default_rng(seed)
    sampler = _ZipfSampler(num_rows, alpha)
    perm = _RandomBijection(num_rows, rng) if permute else None
    trace = []
    for _ in range(num_batches):
        ranks = sampler.sample(rng, batch_lookups)
        trace.append(perm(ranks) if perm is not None else ranks)
    return trace


def criteo_table_sizes(scale: float = 1.0) -> list[int]:
    """Criteo Kaggle cardinalities multiplied by ``scale`` (rounded up, at least 1 row each)."""
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return [max(1, math.ceil(c * scale)) for c in CRITEO_KAGGLE_CARDINALITIES]


def table_offsets(table_sizes: Sequence[int]) -> np.ndarray:
    """Row offset of each table in the concatenated id space (length ``len(table_sizes)``)."""
    sizes = np.asarray(table_sizes, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def criteo_like_trace(
    table_sizes: Sequence[int] | None = None,
    batch_size: int = 2048,
    num_batches: int = 100,
    alpha: float | tuple[float, float] = (0.9, 1.3),
    seed: int = 0,
    *,
    scale: float = 1.0,
    alphas: Sequence[float] | None = None,
) -> list[np.ndarray]:
    """A multi-table trace shaped like Criteo click logs: one lookup per table per example.

    Each table draws Zipf ids (scattered by its own permutation) shifted by the table's offset
    in the concatenated id space, as a single cache over all tables would see them.  Skew
    differs per table: ``alpha`` is either one exponent for every table or a ``(low, high)``
    range from which each table's exponent is drawn uniformly, so some tables are hot and some
    nearly uniform; ``alphas`` gives the exponents explicitly.  ``table_sizes=None`` uses
    :data:`CRITEO_KAGGLE_CARDINALITIES` times ``scale``.  Each batch is ``batch_size`` examples
    laid out example-major: ``batch[e * num_tables + j]`` is example e's id in table j.
    """
    if table_sizes is None:
        sizes = criteo_table_sizes(scale)
    else:
        sizes = [_check_count("table size", s, 1) for s in table_sizes]
        if not sizes:
            raise ValueError("table_sizes must list at least one table")
    batch_size = _check_count("batch_size", batch_size, 1)
    num_batches = _check_count("num_batches", num_batches, 0)
    rng = np.random.default_rng(seed)
    if alphas is not None:
        table_alphas = [float(a) for a in alphas]
        if len(table_alphas) != len(sizes):
            raise ValueError(f"alphas has {len(table_alphas)} entries, expected one per table ({len(sizes)})")
    elif np.ndim(alpha) == 0:
        table_alphas = [float(alpha)] * len(sizes)
    else:
        if len(alpha) != 2 or not alpha[0] <= alpha[1]:
            raise ValueError(f"alpha must be a number or a (low, high) range with low <= high, got {alpha!r}")
        table_alphas = list(rng.uniform(float(alpha[0]), float(alpha[1]), size=len(sizes)))
    offsets = table_offsets(sizes)
    total = batch_size * num_batches
    ids = np.empty((total, len(sizes)), dtype=np.int64)
    for j, (size, a) in enumerate(zip(sizes, table_alphas)):
        ranks = _ZipfSampler(size, a).sample(rng, total)
        ids[:, j] = _RandomBijection(size, rng)(ranks) + offsets[j]
    flat = ids.reshape(num_batches, batch_size * len(sizes))
    return [flat[t] for t in range(num_batches)]


def _as_ids(arr: np.ndarray, where: str) -> np.ndarray:
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: expected integer ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{where}: ids must be non-negative row indices, found {int(arr.min())}")
    return arr


_SEP = re.compile(r"[,\s]+")


def load_trace(path: str | os.PathLike) -> list[np.ndarray]:
    """Read a recorded trace.

    Formats, chosen by suffix:
    * ``.npy``: a 2-D integer array, one row per batch (equal-sized batches);
    * ``.npz``: arrays ``ids`` (1-D) and ``batch_offsets`` (``num_batches + 1`` non-decreasing
      offsets into ``ids``, starting at 0 and ending at ``len(ids)``);
    * anything else: text, one batch per line, ids separated by spaces and/or commas; blank
      lines and lines starting with ``#`` are skipped.
    Ids must be non-negative integers.  Malformed input raises ``ValueError`` naming the file
    (and line, for text).
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path}: not a plain numeric .npy array ({e})") from None
        if arr.ndim != 2:
            raise ValueError(
                f"{path}: expected a 2-D [num_batches, lookups] array, got shape {arr.shape} "
                "(use .npz with ids and batch_offsets for ragged batches)"
            )
        arr = _as_ids(arr, path)
        return [arr[t] for t in range(arr.shape[0])]
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [k for k in ("ids", "batch_offsets") if k not in z.files]
                if missing:
                    raise ValueError(f"{path}: missing array(s) {missing}; found {z.files}, expected ids and batch_offsets")
                ids, offsets = z["ids"], z["batch_offsets"]
        except ValueError as e:
            if str(e).startswith(path):
                raise
            raise ValueError(f"{path}: not a readable .npz of numeric arrays ({e})") from None
        ids = _as_ids(ids, f"{path} (ids)")
        if ids.ndim != 1:
            raise ValueError(f"{path}: ids must be 1-D, got shape {ids.shape}")
        if offsets.ndim != 1 or offsets.size < 1 or not np.issubdtype(offsets.dtype, np.integer):
            raise ValueError(f"{path}: batch_offsets must be a non-empty 1-D integer array, got {offsets.dtype} {offsets.shape}")
        offsets = offsets.astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != ids.size or np.any(np.diff(offsets) < 0):
            raise ValueError(
                f"{path}: batch_offsets must be non-decreasing from 0 to len(ids)={ids.size}, "
                f"got {offsets[0]}..{offsets[-1]}"
                + (" (decreasing somewhere)" if np.any(np.diff(offsets) < 0) else "")
            )
        return [ids[offsets[t]:offsets[t + 1]] for t in range(offsets.size - 1)]
    trace = []
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            tokens = [tok for tok in _SEP.split(text) if tok]
            try:
                ids = np.array([int(tok) for tok in tokens], dtype=np.int64)
            except (ValueError, OverflowError):
                bad = next(tok for tok in tokens if not re.fullmatch(r"[+-]?\d+", tok) or abs(int(tok)) >= 1 << 63)
                raise ValueError(f"{path}:{lineno}: expected integer ids separated by spaces or commas, got {bad!r}") from None
            if ids.size and ids.min() < 0:
                raise ValueError(f"{path}:{lineno}: ids must be non-negative row indices, found {int(ids.min())}")
            trace.append(ids)
    return trace


def save_trace(path: str | os.PathLike, trace: Sequence[np.ndarray]) -> None:
    """Write ``trace`` in the format :func:`load_trace` picks from the suffix of ``path``."""
    path = os.fspath(path)
    batches = [np.asarray(b, dtype=np.int64).ravel() for b in trace]
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        sizes = {b.size for b in batches}
        if len(sizes) > 1:
            raise ValueError(f"{path}: .npy needs equal-sized batches, got sizes {sorted(sizes)[:5]}; use .npz")
        np.save(path, np.stack(batches) if batches else np.empty((0, 0), dtype=np.int64))
    elif suffix == ".npz":
        offsets = np.concatenate([[0], np.cumsum([b.size for b in batches])]).astype(np.int64)
        ids = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
        np.savez(path, ids=ids, batch_offsets=offsets)
    else:
        if any(b.size == 0 for b in batches):
            raise ValueError(f"{path}: text traces cannot hold empty batches (blank lines are skipped); use .npz")
        with open(path, "w", encoding="utf-8") as f:
            for b in batches:
                f.write(" ".join(map(str, b.tolist())) + "\n")
