"""Named run presets: a dataset plus the training defaults that suit it. Command-line flags override them.

Sources (read through the project's reference search; values only, no code):
- MLPerf DLRM-DCNv2 (mlcommons/training recommendation_v2/torchrec_dlrm/README.MD, "Running the MLPerf DLRM v2
  benchmark"): --embedding_dim 128, --dense_arch_layer_sizes 512,256,128, --over_arch_layer_sizes
  1024,1024,512,256,1, --interaction_type=dcn --dcn_num_layers=3 --dcn_low_rank_dim=512, --adagrad (dense and
  embeddings: torch.optim.Adagrad / FBGEMM EXACT_ADAGRAD), --learning_rate 0.005, GLOBAL_BATCH_SIZE=65536,
  --epochs 1; --lr_warmup_steps / --lr_decay_start / --lr_decay_steps left at their default 0
  (facebookresearch/dlrm torchrec_dlrm/dlrm_main.py).
- torchrec's DLRM example (facebookresearch/dlrm torchrec_dlrm/README.MD, 1-GPU row): --batch_size 16384;
  embedding init: torchrec's EmbeddingBagConfig default, uniform(+-sqrt(1 / num_embeddings)), which
  cachedemb.TableConfig reproduces (cachedemb/collection/table_config.py).
- The DLRM paper's Criteo Kaggle benchmark (facebookresearch/dlrm bench/dlrm_s_criteo_kaggle.sh):
  --arch-sparse-feature-size=16 --arch-mlp-bot=13-512-256-64-16 --arch-mlp-top=512-256-1.

Our one departure: a linear warm-up (recipes/dlrm/lr_schedule.py). Adagrad's first update moves every weight by
exactly lr; without a warm-up the second batch's loss of these models jumps far above log(2) (measured on
Criteo-format data in tests/recipes/test_recipe_parity.py::test_first_losses_stay_near_log2; a user saw a first
logged loss of ~10^4 with the former defaults, Adagrad lr 0.05). The reference schedule allows a warm-up
(LRPolicyScheduler, --lr_warmup_steps) but MLPerf's run sets none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .data import AVAZU, CRITEO_KAGGLE, DatasetConfig, criteo_1tb, synthetic_criteo

INTERACTIONS = ("dot", "dcn")


@dataclass(frozen=True)
class RunPreset:
    name: str
    dataset: Callable[[], DatasetConfig]  # built lazily: criteo_1tb() etc.
    embedding_dim: int = 128  # MLPerf DLRM-DCNv2: --embedding_dim 128
    batch_size: int = 65536  # MLPerf DLRM-DCNv2: GLOBAL_BATCH_SIZE=65536 (one process here = the global batch)
    epochs: int = 1  # MLPerf DLRM-DCNv2: --epochs 1
    optimizer: str = "adagrad"  # MLPerf DLRM-DCNv2: --adagrad (embeddings: FBGEMM EXACT_ADAGRAD, element-wise)
    lr: float = 0.005  # MLPerf DLRM-DCNv2: --learning_rate 0.005 (one lr for both optimizers)
    dense_optimizer: str = "adagrad"  # MLPerf DLRM-DCNv2: --adagrad (torch.optim.Adagrad on the dense part)
    dense_lr: float = 0.005
    lr_warmup_steps: int = 100  # ours (see the module docstring); the reference's default is 0
    lr_decay_start: int = 0  # MLPerf DLRM-DCNv2: no decay (--lr_decay_start/--lr_decay_steps default 0)
    lr_decay_steps: int = 0
    cache_ratio: float = 0.01
    dense_arch_layer_sizes: tuple[int, ...] = (512, 256, 128)  # MLPerf: 512,256,128 (the last = embedding_dim)
    over_arch_layer_sizes: tuple[int, ...] = (1024, 1024, 512, 256, 1)  # MLPerf: 1024,1024,512,256,1
    interaction: str = "dcn"  # MLPerf DLRM-DCNv2: --interaction_type=dcn
    dcn_num_layers: int = 3  # MLPerf DLRM-DCNv2: --dcn_num_layers=3
    dcn_low_rank_dim: int = 512  # MLPerf DLRM-DCNv2: --dcn_low_rank_dim=512
    synthetic_samples: int = 0  # synthetic presets only: samples (lines) to generate
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"RunPreset {self.name!r}: interaction={self.interaction!r}; expected one of "
                             f"{INTERACTIONS}")


def _synthetic_demo() -> DatasetConfig:
    # Criteo's 26 features, large tables scaled by 1/25 (~1.4M rows in all): a 1% cache (~14k rows) then holds
    # about half of a 2048-sample batch's distinct ids, and a few 100k rows still teach the planted signal.
    return synthetic_criteo(scale=1 / 25, min_large=5000)


PRESETS: dict[str, RunPreset] = {
    # MLPerf DLRM-DCNv2 as run on Criteo 1TB (tables capped at 40M rows, as MLPerf's --num_embeddings_per_feature).
    # 64k steps per epoch at 65536: a 100-step warm-up is 0.15% of it.
    "criteo-1tb": RunPreset("criteo-1tb", criteo_1tb),
    # Kaggle: the DLRM paper's Kaggle model (dim 16, bottom 512-256-64-16, top 512-256-1, dot interaction),
    # trained with MLPerf's optimizer (Adagrad 0.005 for both; a Kaggle user measured AUC 0.67 at 0.005 against
    # 0.57 at the former 0.05 on a sample) at torchrec's 1-GPU batch of 16384 (~2,100 steps per epoch).
    "criteo-kaggle": RunPreset("criteo-kaggle", lambda: CRITEO_KAGGLE, embedding_dim=16, batch_size=16384,
                               dense_arch_layer_sizes=(512, 256, 64, 16), over_arch_layer_sizes=(512, 256, 1),
                               interaction="dot"),
    # Avazu: no reference recipe; the Kaggle optimizer settings on a smaller model (23 features, 1 dense).
    "avazu": RunPreset("avazu", lambda: AVAZU, embedding_dim=64, batch_size=8192,
                       dense_arch_layer_sizes=(64, 64), over_arch_layer_sizes=(256, 128, 1), interaction="dot"),
    # CPU demo on the planted-signal data: small model, larger learning rates (tuned on that data: AUC ~0.78).
    "synthetic-demo": RunPreset("synthetic-demo", _synthetic_demo, embedding_dim=16, batch_size=2048, epochs=1,
                                optimizer="rowwise_adagrad", lr=0.1, dense_lr=0.05, lr_warmup_steps=0,
                                dense_arch_layer_sizes=(64, 16), over_arch_layer_sizes=(64, 32, 1),
                                interaction="dot", synthetic_samples=400_000),
}

#: --data value -> preset name
DATA_PRESET = {"synthetic": "synthetic-demo", "criteo-kaggle": "criteo-kaggle", "criteo-1tb": "criteo-1tb",
               "avazu": "avazu"}


def get_preset(name: str) -> RunPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
