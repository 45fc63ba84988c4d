"""DLRM (dense MLP, dot or DCNv2 interaction, over MLP) with a CachedEmbeddingBagCollection as its sparse part.

The dense arches are torchrec's (`torchrec.models.dlrm.DenseArch/InteractionArch/InteractionDCNArch/OverArch`,
`torchrec.modules.crossnet.LowRankCrossNet`) when torchrec is installed, else the plain-torch equivalents below
(same layers, same parameter names, same math).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cachedemb import CachedEmbeddingBagCollection, TableConfig
from cachedemb.optim import SparseOptimizer

try:
    from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch
    from torchrec.modules.crossnet import LowRankCrossNet

    HAVE_TORCHREC = True
except ImportError:  # pragma: no cover - exercised only without torchrec
    HAVE_TORCHREC = False


class _MLP(nn.Sequential):
    """Linear + ReLU per layer (torchrec's MLP)."""

    def __init__(self, in_features: int, layer_sizes: list[int]):
        layers: list[nn.Module] = []
        for size in layer_sizes:
            layers += [nn.Linear(in_features, size), nn.ReLU()]
            in_features = size
        super().__init__(*layers)


class PlainDenseArch(nn.Module):
    def __init__(self, in_features: int, layer_sizes: list[int]):
        super().__init__()
        self.model = _MLP(in_features, layer_sizes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class PlainInteractionArch(nn.Module):
    """[dense, pairwise dots of (dense, sparse_1..F)] -> [B, D + (F+1) choose 2]."""

    def __init__(self, num_sparse_features: int):
        super().__init__()
        self.F = num_sparse_features
        self.register_buffer("triu_indices", torch.triu_indices(self.F + 1, self.F + 1, offset=1), persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)  # [B, F + 1, D]
        interactions = torch.bmm(combined, combined.transpose(1, 2))
        return torch.cat((dense_features, interactions[:, self.triu_indices[0], self.triu_indices[1]]), dim=1)


class PlainLowRankCrossNet(nn.Module):
    """DCNv2's low-rank cross layers (MLPerf DLRM-DCNv2's interaction; torchrec's LowRankCrossNet):
    x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l, W_l [N, r], V_l [r, N]; xavier-normal W, V and zero b."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int):
        super().__init__()
        if num_layers < 1 or low_rank < 1:
            raise ValueError(f"LowRankCrossNet: num_layers={num_layers}, low_rank={low_rank}; expected both >= 1")
        self._num_layers = num_layers
        self.W_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank))) for _ in range(num_layers)])
        self.V_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features))) for _ in range(num_layers)])
        self.bias = nn.ParameterList([nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)])

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for W, V, b in zip(self.W_kernels, self.V_kernels, self.bias):
            x = x0 * (nn.functional.linear(nn.functional.linear(x, V), W) + b) + x
        return x


class PlainInteractionDCNArch(nn.Module):
    """[dense, sparse_1..F] flattened to [B, (F + 1) D], then the cross net (torchrec's InteractionDCNArch)."""

    def __init__(self, num_sparse_features: int, crossnet: nn.Module):
        super().__init__()
        self.F = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return self.crossnet(combined.reshape(dense_features.shape[0], -1))


class PlainOverArch(nn.Module):
    def __init__(self, in_features: int, layer_sizes: list[int]):
        super().__init__()
        if len(layer_sizes) <= 1:
            raise ValueError(f"OverArch needs at least two layer sizes, got {layer_sizes}")
        self.model = nn.Sequential(_MLP(in_features, layer_sizes[:-1]), nn.Linear(layer_sizes[-2], layer_sizes[-1]))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


@dataclass(frozen=True)
class DLRMConfig:
    num_dense: int
    cat_names: tuple[str, ...]
    table_sizes: tuple[int, ...]
    embedding_dim: int
    dense_arch_layer_sizes: tuple[int, ...] = (512, 256)  # the last is set to embedding_dim
    over_arch_layer_sizes: tuple[int, ...] = (512, 256, 1)
    interaction: str = "dot"  # "dot" (DLRM) or "dcn" (DCNv2 low-rank cross layers, MLPerf's DLRM-DCNv2)
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 512

    def __post_init__(self):
        if self.interaction not in ("dot", "dcn"):
            raise ValueError(f"DLRMConfig: interaction={self.interaction!r}; expected 'dot' or 'dcn'")
        if self.interaction == "dcn" and (self.dcn_num_layers < 1 or self.dcn_low_rank_dim < 1):
            raise ValueError(f"DLRMConfig: dcn_num_layers={self.dcn_num_layers}, dcn_low_rank_dim="
                             f"{self.dcn_low_rank_dim}; expected both >= 1")
        if len(self.cat_names) != len(self.table_sizes) or not self.cat_names:
            raise ValueError(f"DLRMConfig: {len(self.cat_names)} categorical names but {len(self.table_sizes)} "
                             "table sizes; expected equal, non-zero counts")
        if self.num_dense < 1:
            raise ValueError(f"DLRMConfig: num_dense={self.num_dense}; DLRM's dense arch needs >= 1 dense feature")
        if self.over_arch_layer_sizes[-1] != 1 or len(self.over_arch_layer_sizes) < 2:
            raise ValueError(f"DLRMConfig: over_arch_layer_sizes must have >= 2 sizes ending in 1, got "
                             f"{self.over_arch_layer_sizes}")

    def interaction_out_features(self) -> int:
        """Width of the over arch's input: D + F(F+1)/2 pairwise dots (dot), or (F + 1) D (dcn)."""
        f, d = len(self.cat_names), self.embedding_dim
        return d + f + f * (f - 1) // 2 if self.interaction == "dot" else (f + 1) * d

    def tables(self) -> list[TableConfig]:
        """One table per categorical feature, named `t_{feature}`."""
        return [TableConfig(f"t_{name}", int(size), self.embedding_dim, [name])
                for name, size in zip(self.cat_names, self.table_sizes)]


class DLRM(nn.Module):
    """logits [B] = over(interaction(dense_arch(dense), sparse(ids))).

    `forward(dense [B, num_dense] float, sparse [B, num_cat] int64)`: one id per (sample, feature), columns
    in `config.cat_names` order; a torchrec KeyedJaggedTensor also works as `sparse`. `sparse_arch` replaces
    the CachedEmbeddingBagCollection by any module with its interface (e.g. torchrec's EmbeddingBagCollection,
    which takes a KeyedJaggedTensor), so the same model can be trained with all rows in memory.
    """

    def __init__(self, config: DLRMConfig, *, cache_ratio: float = 0.01, optimizer: SparseOptimizer | None = None,
                 id_freq=None, device=None, use_torchrec: bool | None = None, sparse_arch: nn.Module | None = None,
                 **collection_kwargs):
        super().__init__()
        self.config = config
        use_torchrec = HAVE_TORCHREC if use_torchrec is None else use_torchrec
        if use_torchrec and not HAVE_TORCHREC:
            raise ValueError("use_torchrec=True but torchrec is not installed")
        dim = config.embedding_dim
        dense_sizes = list(config.dense_arch_layer_sizes[:-1]) + [dim]
        num_cat = len(config.cat_names)
        over_in = config.interaction_out_features()
        if sparse_arch is None:
            sparse_arch = CachedEmbeddingBagCollection(config.tables(), cache_ratio=cache_ratio, optimizer=optimizer,
                                                       id_freq=id_freq, device=device, **collection_kwargs)
        self.sparse_arch = sparse_arch
        if use_torchrec:
            self.dense_arch = DenseArch(config.num_dense, dense_sizes, device=device)
            if config.interaction == "dcn":
                crossnet = LowRankCrossNet(in_features=(num_cat + 1) * dim, num_layers=config.dcn_num_layers,
                                           low_rank=config.dcn_low_rank_dim)
                self.inter_arch = InteractionDCNArch(num_cat, crossnet)
            else:
                self.inter_arch = InteractionArch(num_cat)
            self.over_arch = OverArch(over_in, list(config.over_arch_layer_sizes), device=device)
        else:
            self.dense_arch = PlainDenseArch(config.num_dense, dense_sizes)
            if config.interaction == "dcn":
                crossnet = PlainLowRankCrossNet((num_cat + 1) * dim, config.dcn_num_layers, config.dcn_low_rank_dim)
                self.inter_arch = PlainInteractionDCNArch(num_cat, crossnet)
            else:
                self.inter_arch = PlainInteractionArch(num_cat)
            self.over_arch = PlainOverArch(over_in, list(config.over_arch_layer_sizes))
        if device is None and isinstance(sparse_arch, CachedEmbeddingBagCollection):
            device = sparse_arch.device  # its default (CUDA when there is one): the dense arches go with it
        if device is not None:
            for arch in (self.dense_arch, self.inter_arch, self.over_arch):
                arch.to(device)

    def dense_parameters(self) -> list[nn.Parameter]:
        """Everything but the embeddings (which the collection's fused optimizer updates)."""
        sparse = {id(p) for p in self.sparse_arch.parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def prefetch_targets(self, batch) -> list:
        """`cachedemb.prefetch` protocol for the recipe's batches (anything with a `.sparse` id tensor)."""
        return self.sparse_arch.prefetch_targets(batch.sparse)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        pooled = self.sparse_arch(sparse)
        if not isinstance(pooled, dict):  # a KeyedTensor (KJT input)
            pooled = pooled.to_dict()
        embedded = torch.stack([pooled[name] for name in self.config.cat_names], dim=1)  # [B, F, D]
        dense_out = self.dense_arch(dense)
        return self.over_arch(self.inter_arch(dense_out, embedded)).squeeze(-1)
