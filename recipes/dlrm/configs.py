"""Named run presets: a dataset plus the training defaults that suit it. Command-line flags override them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from recipes.dlrm.data import AVAZU, CRITEO_KAGGLE, DatasetConfig, criteo_1tb, synthetic_criteo


@dataclass(frozen=True)
class RunPreset:
    name: str
    dataset: Callable[[], DatasetConfig]  # built lazily: criteo_1tb() etc.
    embedding_dim: int = 128
    batch_size: int = 16384
    epochs: int = 1
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.05
    dense_optimizer: str = "adagrad"
    dense_lr: float = 0.05
    cache_ratio: float = 0.01
    dense_arch_layer_sizes: tuple[int, ...] = (512, 256)
    over_arch_layer_sizes: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    synthetic_rows: int = 0  # synthetic presets only: rows to generate
    extra: dict = field(default_factory=dict)


def _synthetic_demo() -> DatasetConfig:
    # Criteo's 26 features, large tables scaled by 1/25 (~1.4M rows in all): a 1% cache (~14k rows) then holds
    # about half of a 2048-sample batch's distinct ids, and a few 100k rows still teach the planted signal.
    return synthetic_criteo(scale=1 / 25, min_large=5000)


PRESETS: dict[str, RunPreset] = {
    "criteo-kaggle": RunPreset("criteo-kaggle", lambda: CRITEO_KAGGLE),
    "criteo-1tb": RunPreset("criteo-1tb", criteo_1tb, over_arch_layer_sizes=(1024, 1024, 512, 256, 1)),
    "avazu": RunPreset("avazu", lambda: AVAZU, embedding_dim=64, batch_size=8192,
                       dense_arch_layer_sizes=(64, 64), over_arch_layer_sizes=(256, 128, 1)),
    "synthetic-demo": RunPreset("synthetic-demo", _synthetic_demo, embedding_dim=16, batch_size=2048, epochs=1,
                                lr=0.1, dense_lr=0.05, dense_arch_layer_sizes=(64, 16),
                                over_arch_layer_sizes=(64, 32, 1), synthetic_rows=400_000),
}

#: --data value -> preset name
DATA_PRESET = {"synthetic": "synthetic-demo", "criteo-kaggle": "criteo-kaggle", "criteo-1tb": "criteo-1tb",
               "avazu": "avazu"}


def get_preset(name: str) -> RunPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
