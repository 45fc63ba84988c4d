"""Synthetic CTR data written in the raw Criteo TSV / Avazu CSV formats.

Real Criteo is 11 GB (Kaggle) to 1 TB, so demos and tests need a stand-in that
exercises the same reader/preprocessing path and has the two properties that matter
for an embedding cache: power-law (Zipf) id frequencies, and labels a model can
actually learn. Labels follow a planted logistic model:

    P(click) = sigmoid(bias + sum_f w_f(id_f) + sum_j beta_j * (log1p(max(x_j, 0)) - mu_j))

where ``w_f`` is a hidden per-(feature, id) weight derived from a hash (so no table
of weights is ever stored) and missing ids have weight 0.

Output depends only on the arguments (including ``seed``): rows are generated in
fixed blocks of :data:`BLOCK_ROWS`, each from its own seeded RNG, and written out
block by block, so memory stays bounded for any ``num_rows``. ``progress(stage, done, total, unit)``, when
given, is called at the start and after each block (the recipe draws its progress bar from it; nothing here
prints).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .avazu import AVAZU_HEADER, splitmix64
from .configs import AVAZU_APPROX_CARDINALITIES, AVAZU_HASHED_COLUMNS, SYNTHETIC_CRITEO
from .criteo import CRITEO_NUM_CAT, CRITEO_NUM_DENSE

#: progress(stage, done, total, unit): `done` of `total` units of `stage` finished so far.
Progress = Callable[[str, int, int, str], None]

__all__ = [
    "BLOCK_ROWS",
    "Progress",
    "SYNTHETIC_AVAZU_CARDINALITIES",
    "AVAZU_DECIMAL_COLUMNS",
    "PlantedSignal",
    "zipf_ranks",
    "write_criteo_tsv",
    "write_avazu_csv",
]

BLOCK_ROWS = 1 << 15

#: Avazu columns holding decimal codes in the real file (the rest are 8-hex-digit ids).
AVAZU_DECIMAL_COLUMNS = frozenset(
    ["C1", "banner_pos", "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"]
)

#: Per-column cardinalities for synthetic Avazu: the real ones capped at 100k.
SYNTHETIC_AVAZU_CARDINALITIES = tuple(min(AVAZU_APPROX_CARDINALITIES[c] + 1, 100_000) for c in AVAZU_HASHED_COLUMNS)

_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(28, -1, -4, dtype=np.uint64)
_TWO64 = float(2**64)


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r}; expected a non-negative int")


def zipf_ranks(rng: np.random.Generator, n: int, num_values: int, alpha: float) -> np.ndarray:
    """Draw ``n`` ranks in ``[1, num_values]`` with P(rank=k) roughly proportional to k**-alpha.

    Inverse-CDF of the continuous power law on ``[1, num_values + 1)``, floored: O(n)
    time and no O(num_values) table, so it works for 40M-value features.
    """
    if num_values < 1:
        raise ValueError(f"zipf_ranks: num_values={num_values!r}; expected >= 1")
    u = rng.random(n)
    top = float(num_values + 1)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * math.log(top))
    else:
        e = 1.0 - alpha
        x = (1.0 - u * (1.0 - top**e)) ** (1.0 / e)
    return np.clip(np.floor(x), 1, num_values).astype(np.int64)


@dataclass(frozen=True)
class PlantedSignal:
    """The hidden logistic model behind synthetic labels.

    Categorical ids are in ``[1, cardinality)``; id 0 means missing and has weight 0.
    Weights are uniform with standard deviation ``cat_scale / sqrt(num_features)`` so the
    categorical part of the logit has std ~``cat_scale`` whatever the feature count.
    """

    cardinalities: tuple[int, ...]
    num_dense: int
    seed: int
    bias: float = -1.2
    cat_scale: float = 1.5
    dense_scale: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "cardinalities", tuple(int(c) for c in self.cardinalities))
        _check_seed(self.seed)
        for i, c in enumerate(self.cardinalities):
            if c < 2:
                raise ValueError(f"PlantedSignal: cardinality of feature {i} is {c}; expected >= 2 (id 0 is 'missing')")
        if self.num_dense < 0:
            raise ValueError(f"PlantedSignal: num_dense={self.num_dense!r}; expected >= 0")
        rng = np.random.default_rng([int(self.seed), 1])
        d = self.num_dense
        object.__setattr__(self, "dense_mu", rng.uniform(0.5, 4.0, d))
        object.__setattr__(self, "dense_sigma", rng.uniform(0.5, 1.5, d))
        beta = rng.standard_normal(d) * (self.dense_scale / math.sqrt(max(d, 1)))
        object.__setattr__(self, "dense_beta", beta)
        # rank -> id bijection per feature: id = 1 + ((rank - 1) * a + b) % (card - 1), gcd(a, card - 1) = 1,
        # so the hottest ids are scattered over the table instead of sitting at 1, 2, 3...
        perms = []
        for c in self.cardinalities:
            m = c - 1
            a = int(rng.integers(1, max(m, 2)))
            while math.gcd(a, m) != 1:
                a += 1
            perms.append((a % m if m > 1 else 1, int(rng.integers(0, m))))
        object.__setattr__(self, "id_perm", tuple(perms))

    @property
    def num_features(self) -> int:
        return len(self.cardinalities)

    def weights(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """Hidden weight of each id of one feature (float64, 0 where id == 0)."""
        key = splitmix64(np.uint64(self.seed) * np.uint64(1_000_003) + np.uint64(feature))
        u = splitmix64(np.asarray(ids).astype(np.uint64) ^ key).astype(np.float64) / _TWO64
        half_width = math.sqrt(3.0) * self.cat_scale / math.sqrt(self.num_features)
        return np.where(np.asarray(ids) == 0, 0.0, (2.0 * u - 1.0) * half_width)

    def logits(self, cats: np.ndarray, dense: np.ndarray | None = None) -> np.ndarray:
        """True logit per row. ``cats`` int64 ``[n, F]`` (0 = missing), ``dense`` raw values ``[n, D]``."""
        cats = np.asarray(cats)
        if cats.ndim != 2 or cats.shape[1] != self.num_features:
            raise ValueError(f"PlantedSignal.logits: cats shape {cats.shape}; expected [n, {self.num_features}]")
        out = np.full(cats.shape[0], self.bias, dtype=np.float64)
        for f in range(self.num_features):
            out += self.weights(f, cats[:, f])
        if self.num_dense:
            dense = np.asarray(dense, dtype=np.float64)
            if dense.shape != (cats.shape[0], self.num_dense):
                raise ValueError(
                    f"PlantedSignal.logits: dense shape {dense.shape}; expected ({cats.shape[0]}, {self.num_dense})"
                )
            out += ((np.log1p(np.maximum(dense, 0.0)) - self.dense_mu) * self.dense_beta).sum(axis=1)
        return out

    def sample_ids(self, rng: np.random.Generator, n: int, alpha: float) -> np.ndarray:
        """Zipf-distributed ids ``[n, F]`` in ``[1, cardinality)``."""
        out = np.empty((n, self.num_features), dtype=np.int64)
        for f, (c, (a, b)) in enumerate(zip(self.cardinalities, self.id_perm)):
            ranks = zipf_ranks(rng, n, c - 1, alpha)
            out[:, f] = 1 + ((ranks - 1) * a + b) % (c - 1)
        return out

    def sample_dense(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Non-negative integer counts ``[n, D]`` (int64), log-normal like Criteo's I-features."""
        z = rng.standard_normal((n, self.num_dense)) * self.dense_sigma + self.dense_mu
        return np.maximum(np.floor(np.expm1(z)), 0).astype(np.int64)

    def sample_labels(self, rng: np.random.Generator, logits: np.ndarray) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-logits))
        return (rng.random(logits.shape[0]) < p).astype(np.int8)


def _hex8(ids: np.ndarray) -> np.ndarray:
    """uint32-range ints -> 8-lowercase-hex-digit bytes (``S8``), vectorised."""
    nib = (ids.astype(np.uint64)[..., None] >> _NIBBLE_SHIFTS) & np.uint64(15)
    return np.ascontiguousarray(_HEX_DIGITS[nib.astype(np.intp)]).view("S8").reshape(ids.shape)


def _validate_common(num_rows: int, alpha: float, missing_rate: float) -> None:
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
        raise ValueError(f"num_rows={num_rows!r}; expected a non-negative int")
    if not (0.5 <= alpha <= 3.0):
        raise ValueError(f"alpha={alpha!r}; expected a Zipf exponent in [0.5, 3] (Criteo-like data: 1.05-1.2)")
    if not (0.0 <= missing_rate < 1.0):
        raise ValueError(f"missing_rate={missing_rate!r}; expected 0 <= missing_rate < 1")


def _blocks(num_rows: int):
    for b, start in enumerate(range(0, num_rows, BLOCK_ROWS)):
        yield b, min(BLOCK_ROWS, num_rows - start)


def _emit(f, sep: bytes, cols: list[list[bytes]]) -> None:
    f.write(b"\n".join(map(sep.join, zip(*cols))))
    f.write(b"\n")


def write_criteo_tsv(
    path: str | os.PathLike,
    num_rows: int,
    cardinalities: Sequence[int] = SYNTHETIC_CRITEO.table_sizes,
    seed: int = 0,
    *,
    alpha: float = 1.1,
    missing_rate: float = 0.02,
    bias: float = -1.2,
    cat_scale: float = 1.5,
    dense_scale: float = 0.5,
    progress: Progress | None = None,
) -> PlantedSignal:
    """Write ``num_rows`` Criteo-format lines (label, 13 dense, 26 hex categoricals).

    Categorical ``f`` takes ids in ``[1, cardinalities[f])`` written as 8 hex digits, so
    after preprocessing (``% table_size`` with table_size = cardinality) the ids are
    unchanged and an empty field (id 0) is the "missing" row. Each dense and
    categorical field is empty with probability ``missing_rate``.
    Returns the :class:`PlantedSignal` that generated the labels.
    """
    _check_seed(seed)
    _validate_common(num_rows, alpha, missing_rate)
    if len(cardinalities) != CRITEO_NUM_CAT:
        raise ValueError(f"write_criteo_tsv: {len(cardinalities)} cardinalities; expected {CRITEO_NUM_CAT}")
    if max(cardinalities) > 2**32:
        raise ValueError(f"write_criteo_tsv: max cardinality {max(cardinalities)}; expected <= 2**32 (8 hex digits)")
    signal = PlantedSignal(tuple(cardinalities), CRITEO_NUM_DENSE, int(seed), bias, cat_scale, dense_scale)
    if progress is not None:
        progress("generating", 0, num_rows, "samples")
    with open(os.fspath(path), "wb") as f:
        for b, n in _blocks(num_rows):
            rng = np.random.default_rng([int(seed), 0, b])
            cats = signal.sample_ids(rng, n, alpha)
            dense = signal.sample_dense(rng, n)
            cats[rng.random(cats.shape) < missing_rate] = 0
            dense_missing = rng.random(dense.shape) < missing_rate
            dense[dense_missing] = 0
            labels = signal.sample_labels(rng, signal.logits(cats, dense))
            dense_s = np.where(dense_missing, b"", dense.astype(np.bytes_))
            cats_s = np.where(cats == 0, b"", _hex8(cats))
            cols = [labels.astype(np.bytes_).tolist()]
            cols += [dense_s[:, j].tolist() for j in range(CRITEO_NUM_DENSE)]
            cols += [cats_s[:, j].tolist() for j in range(CRITEO_NUM_CAT)]
            _emit(f, b"\t", cols)
            if progress is not None:
                progress("generating", b * BLOCK_ROWS + n, num_rows, "samples")
    return signal


def write_avazu_csv(
    path: str | os.PathLike,
    num_rows: int,
    cardinalities: Sequence[int] = SYNTHETIC_AVAZU_CARDINALITIES,
    seed: int = 0,
    *,
    alpha: float = 1.1,
    missing_rate: float = 0.01,
    start_date: str = "2014-10-21",
    num_days: int = 10,
    bias: float = -1.6,
    cat_scale: float = 1.5,
    progress: Progress | None = None,
) -> PlantedSignal:
    """Write an Avazu-format CSV (header + ``num_rows`` lines).

    ``cardinalities`` gives the 21 raw categorical columns in header order; ids are
    written as 8 hex digits, or in decimal for :data:`AVAZU_DECIMAL_COLUMNS`. ``hour``
    is uniform over ``num_days`` days from ``start_date``; hour-of-day is a 22nd planted
    feature. Categorical fields are empty with probability ``missing_rate``.
    Returns the :class:`PlantedSignal` (features: 21 columns, then hour-of-day).
    """
    _check_seed(seed)
    _validate_common(num_rows, alpha, missing_rate)
    if len(cardinalities) != len(AVAZU_HASHED_COLUMNS):
        raise ValueError(
            f"write_avazu_csv: {len(cardinalities)} cardinalities; expected {len(AVAZU_HASHED_COLUMNS)} "
            f"(one per column {', '.join(AVAZU_HASHED_COLUMNS)})"
        )
    if max(cardinalities) > 2**32:
        raise ValueError(f"write_avazu_csv: max cardinality {max(cardinalities)}; expected <= 2**32")
    if num_days < 1:
        raise ValueError(f"write_avazu_csv: num_days={num_days!r}; expected >= 1")
    start = np.datetime64(start_date, "D")
    ncol = len(AVAZU_HASHED_COLUMNS)
    # Hour-of-day rides along as feature 22 so the derived categoricals carry signal too.
    signal = PlantedSignal(tuple(cardinalities) + (25,), 0, int(seed), bias, cat_scale, 0.0)
    if progress is not None:
        progress("generating", 0, num_rows, "samples")
    with open(os.fspath(path), "wb") as f:
        f.write(AVAZU_HEADER.encode() + b"\n")
        for b, n in _blocks(num_rows):
            rng = np.random.default_rng([int(seed), 0, b])
            ids = signal.sample_ids(rng, n, alpha)
            hour = rng.integers(0, 24, n)
            ids[:, ncol] = hour + 1  # ids start at 1; 0 is reserved for "missing"
            ids[:, :ncol][rng.random((n, ncol)) < missing_rate] = 0
            labels = signal.sample_labels(rng, signal.logits(ids))
            day = start + rng.integers(0, num_days, n)
            month_start = day.astype("datetime64[M]")
            year = month_start.astype("datetime64[Y]").astype(np.int64) + 1970
            month = month_start.astype(np.int64) % 12 + 1
            dom = (day - month_start.astype("datetime64[D]")).astype(np.int64) + 1
            stamp = (year % 100) * 1_000_000 + month * 10_000 + dom * 100 + hour
            row_ids = rng.integers(0, 2**63 - 1, n, dtype=np.int64).astype(np.uint64) * np.uint64(2)
            cols = [row_ids.astype(np.bytes_).tolist(), labels.astype(np.bytes_).tolist(),
                    np.char.zfill(stamp.astype(np.bytes_), 8).tolist()]
            for j, name in enumerate(AVAZU_HASHED_COLUMNS):
                text = ids[:, j].astype(np.bytes_) if name in AVAZU_DECIMAL_COLUMNS else _hex8(ids[:, j])
                cols.append(np.where(ids[:, j] == 0, b"", text).tolist())
            _emit(f, b",", cols)
            if progress is not None:
                progress("generating", b * BLOCK_ROWS + n, num_rows, "samples")
    return signal
