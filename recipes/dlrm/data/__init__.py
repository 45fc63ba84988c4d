"""Data pipeline for the DLRM recipe: dataset configs, raw readers, a synthetic
generator, preprocessing to memory-mapped ``.npy`` and a batch loader."""

from .avazu import AVAZU_HEADER, hash_categorical, read_avazu_csv, splitmix64
from .configs import (
    AVAZU,
    CRITEO_1TB,
    CRITEO_KAGGLE,
    SYNTHETIC_CRITEO,
    DatasetConfig,
    criteo_1tb,
    synthetic_criteo,
)
from .criteo import MISSING_CAT, RawChunk, parse_int_fields, read_criteo_tsv
from .loader import Batch, PreprocessedSplit, iter_batches
from .preprocess import (
    DENSE_TRANSFORM,
    SPLITS,
    count_lines,
    dense_transform,
    load_id_freq,
    load_metadata,
    preprocess_avazu,
    preprocess_criteo_1tb,
    preprocess_criteo_kaggle,
    preprocess_files,
)
from .synthetic import PlantedSignal, write_avazu_csv, write_criteo_tsv, zipf_ranks

__all__ = [
    "AVAZU", "AVAZU_HEADER", "CRITEO_1TB", "CRITEO_KAGGLE", "SYNTHETIC_CRITEO", "DatasetConfig",
    "criteo_1tb", "synthetic_criteo",
    "MISSING_CAT", "RawChunk", "parse_int_fields", "read_criteo_tsv",
    "hash_categorical", "read_avazu_csv", "splitmix64",
    "PlantedSignal", "write_avazu_csv", "write_criteo_tsv", "zipf_ranks",
    "DENSE_TRANSFORM", "SPLITS", "count_lines", "dense_transform", "load_id_freq", "load_metadata",
    "preprocess_avazu", "preprocess_criteo_1tb", "preprocess_criteo_kaggle", "preprocess_files",
    "Batch", "PreprocessedSplit", "iter_batches",
]
