"""Dataset descriptions: feature names and embedding-table sizes.

A config is the single place that says how many rows each categorical feature's
table has; the preprocessing step reduces raw ids into exactly these sizes
(``raw % table_size``) so the model can build its tables from the config alone.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

__all__ = [
    "RAW_FORMATS",
    "DatasetConfig",
    "CRITEO_KAGGLE",
    "CRITEO_1TB_COUNTS",
    "criteo_1tb",
    "CRITEO_1TB",
    "AVAZU_COLUMNS",
    "AVAZU_HASHED_COLUMNS",
    "AVAZU_APPROX_CARDINALITIES",
    "AVAZU_MAX_TABLE_SIZE",
    "AVAZU",
    "synthetic_criteo",
    "SYNTHETIC_CRITEO",
]

#: Raw on-disk formats the readers understand; a config names the one its files use.
RAW_FORMATS = ("criteo_tsv", "avazu_csv")


def _as_int(value):
    """numpy integers -> int (so sizes from arrays work); anything else is left for validation."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


@dataclass(frozen=True)
class DatasetConfig:
    """Shape of one CTR dataset as the model sees it after preprocessing.

    ``table_sizes[i]`` is ``num_embeddings`` of categorical feature ``cat_names[i]``.
    """

    name: str
    raw_format: str
    dense_names: tuple[str, ...]
    cat_names: tuple[str, ...]
    table_sizes: tuple[int, ...]
    embedding_dim: int = 128

    def __post_init__(self) -> None:
        # Normalise lists to tuples so configs stay hashable and immutable.
        for field in ("dense_names", "cat_names", "table_sizes"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        object.__setattr__(self, "table_sizes", tuple(_as_int(s) for s in self.table_sizes))
        if not self.name:
            raise ValueError("DatasetConfig.name must be a non-empty string")
        if self.raw_format not in RAW_FORMATS:
            raise ValueError(
                f"DatasetConfig {self.name!r}: raw_format={self.raw_format!r}, expected one of {RAW_FORMATS}"
            )
        if len(self.cat_names) != len(self.table_sizes):
            raise ValueError(
                f"DatasetConfig {self.name!r}: {len(self.cat_names)} categorical names but "
                f"{len(self.table_sizes)} table sizes; expected equal lengths"
            )
        if not self.cat_names:
            raise ValueError(f"DatasetConfig {self.name!r}: expected at least one categorical feature")
        names = self.dense_names + self.cat_names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"DatasetConfig {self.name!r}: duplicate feature names {dup}; expected unique names")
        for fname, size in zip(self.cat_names, self.table_sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"DatasetConfig {self.name!r}: table size of {fname!r} is {size!r}; expected a positive int"
                )
        if isinstance(self.embedding_dim, bool) or not isinstance(self.embedding_dim, int) or self.embedding_dim < 1:
            raise ValueError(
                f"DatasetConfig {self.name!r}: embedding_dim={self.embedding_dim!r}; expected a positive int"
            )

    @property
    def num_dense(self) -> int:
        return len(self.dense_names)

    @property
    def num_cat(self) -> int:
        return len(self.cat_names)

    @property
    def total_rows(self) -> int:
        """Rows over all embedding tables (what a full, uncached model would hold)."""
        return sum(self.table_sizes)


_CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
_CRITEO_CAT = tuple(f"C{i}" for i in range(1, 27))

#: Criteo Kaggle (Display Advertising Challenge): per-feature distinct-value counts of train.txt.
CRITEO_KAGGLE = DatasetConfig(
    name="criteo_kaggle",
    raw_format="criteo_tsv",
    dense_names=_CRITEO_DENSE,
    cat_names=_CRITEO_CAT,
    table_sizes=(
        1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
        27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
    ),
)

#: Criteo 1TB Click Logs: per-feature counts used by torchrec's DLRM example (before capping).
CRITEO_1TB_COUNTS = (
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
)


def criteo_1tb(cap: int = 40_000_000, embedding_dim: int = 128) -> DatasetConfig:
    """Criteo 1TB with every table capped at ``cap`` rows (the MLPerf/torchrec convention:
    ids beyond the cap are folded in by ``raw % size``)."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"criteo_1tb: cap={cap!r}; expected a positive int")
    return DatasetConfig(
        name="criteo_1tb" if cap == 40_000_000 else f"criteo_1tb_cap{cap}",
        raw_format="criteo_tsv",
        dense_names=_CRITEO_DENSE,
        cat_names=_CRITEO_CAT,
        table_sizes=tuple(min(c, cap) for c in CRITEO_1TB_COUNTS),
        embedding_dim=embedding_dim,
    )


CRITEO_1TB = criteo_1tb()

#: Header of Avazu's train.csv, in order.
AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
)

#: The 21 raw categorical columns (everything except id, click, hour), hashed by the reader.
AVAZU_HASHED_COLUMNS = AVAZU_COLUMNS[3:]

#: Distinct values per column in Avazu's 40.4M-row train.csv (rounded public statistics);
#: only used to size the tables, so approximate is enough.
AVAZU_APPROX_CARDINALITIES = {
    "C1": 7, "banner_pos": 7, "site_id": 4737, "site_domain": 7745, "site_category": 26,
    "app_id": 8552, "app_domain": 559, "app_category": 36, "device_id": 2686408,
    "device_ip": 6729486, "device_model": 8251, "device_type": 5, "device_conn_type": 4,
    "C14": 2626, "C15": 8, "C16": 9, "C17": 435, "C18": 4, "C19": 68, "C20": 172, "C21": 60,
}

#: Largest Avazu table; device_id and device_ip are folded into it.
AVAZU_MAX_TABLE_SIZE = 1 << 22


def _avazu_table_size(cardinality: int) -> int:
    # Values are hashed, so a table exactly the cardinality would collide ~37% of
    # values; 4x the cardinality keeps collisions near 12% at a small memory cost.
    return min(4 * cardinality, AVAZU_MAX_TABLE_SIZE)


#: Avazu CTR. Categoricals: the 21 hashed raw columns (table = min(4 * cardinality, 2**22)),
#: then hour-of-day (24) and weekday (7) derived from ``hour``. Dense: hour-of-day / 23,
#: so DLRM's bottom MLP has an input.
AVAZU = DatasetConfig(
    name="avazu",
    raw_format="avazu_csv",
    dense_names=("hour_frac",),
    cat_names=AVAZU_HASHED_COLUMNS + ("hour_of_day", "weekday"),
    table_sizes=tuple(_avazu_table_size(AVAZU_APPROX_CARDINALITIES[c]) for c in AVAZU_HASHED_COLUMNS) + (24, 7),
)


def synthetic_criteo(
    scale: float = 1 / 25, min_large: int = 10_000, embedding_dim: int = 128
) -> DatasetConfig:
    """Criteo-shaped config small enough for a CPU demo.

    Kaggle tables larger than ``min_large`` are scaled by ``scale`` (but kept at least
    ``min_large``); small ones keep their true size. Defaults give ~1.4M rows in all.
    """
    if not (0 < scale <= 1):
        raise ValueError(f"synthetic_criteo: scale={scale!r}; expected 0 < scale <= 1")
    if min_large < 2:
        raise ValueError(f"synthetic_criteo: min_large={min_large!r}; expected >= 2")
    sizes = tuple(
        c if c <= min_large else max(min_large, int(math.ceil(c * scale))) for c in CRITEO_KAGGLE.table_sizes
    )
    return DatasetConfig(
        name="synthetic_criteo",
        raw_format="criteo_tsv",
        dense_names=_CRITEO_DENSE,
        cat_names=_CRITEO_CAT,
        table_sizes=sizes,
        embedding_dim=embedding_dim,
    )


SYNTHETIC_CRITEO = synthetic_criteo()
