"""TableConfig: one embedding table of a CachedEmbeddingBagCollection; `from_config` reads torchrec's
EmbeddingBagConfig (duck-typed: torchrec is not imported)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from cachedemb.dynamic.embedding_bag import DynamicIds
from cachedemb.modules.input_check import integer_arg
from cachedemb.modules.meta_init import TableInit

POOLINGS = ("sum", "mean")
DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}  # torchrec DataType names
TABLE_DTYPES = (*DTYPES.values(), torch.float64)


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_embeddings` rows of `embedding_dim`, looked up by each of `feature_names`
    (none: one feature named as the table, as torchrec does), pooled by `pooling`, stored as `dtype` (float32,
    float16, bfloat16, or float64 where CachedEmbeddingBag supports it), initialized by `init_fn(rows)`
    (default: uniform in +-sqrt(1 / num_embeddings), torchrec's default).

    `dynamic=DynamicIds(...)`: the table's features carry raw int64 ids (cachedemb.dynamic): a row per admitted
    id, created as `initial_rows(seed, id)` (so no init_fn); `num_embeddings` is then the slab capacity (None, or
    equal to `dynamic.capacity`)."""

    name: str
    num_embeddings: int | None
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    pooling: str = "sum"
    dtype: torch.dtype = torch.float32
    init_fn: Callable[[torch.Tensor], object] | None = None
    dynamic: DynamicIds | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(f"TableConfig.name must be a non-empty string without '.', got {self.name!r}")
        if self.dynamic is not None:
            self._check_dynamic()
        for field in ("num_embeddings", "embedding_dim"):
            value = integer_arg(f"TableConfig {self.name!r}: {field}", getattr(self, field))
            if value < 1:
                raise ValueError(f"TableConfig {self.name!r}: {field} must be a positive int, got {value!r}")
            object.__setattr__(self, field, value)
        if isinstance(self.feature_names, str):
            raise ValueError(f"TableConfig {self.name!r}: feature_names must be a list of names, got the string "
                             f"{self.feature_names!r}; write [{self.feature_names!r}]")
        names = tuple(self.feature_names) or (self.name,)
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"TableConfig {self.name!r}: feature_names must be non-empty strings, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"TableConfig {self.name!r}: duplicated feature names in {names!r}")
        object.__setattr__(self, "feature_names", names)
        if self.pooling not in POOLINGS:
            raise ValueError(f"TableConfig {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.dtype not in TABLE_DTYPES:
            raise ValueError(f"TableConfig {self.name!r}: dtype must be one of "
                             f"{', '.join(str(d).replace('torch.', '') for d in TABLE_DTYPES)}, got {self.dtype}")
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(f"TableConfig {self.name!r}: init_fn must be callable, got {self.init_fn!r}")

    def _check_dynamic(self) -> None:
        if not isinstance(self.dynamic, DynamicIds):
            raise ValueError(f"TableConfig {self.name!r}: dynamic must be a cachedemb.DynamicIds or None, got "
                             f"{type(self.dynamic).__name__}")
        cap = self.dynamic.capacity
        if self.num_embeddings is None:
            object.__setattr__(self, "num_embeddings", cap)
        elif self.num_embeddings != cap:
            raise ValueError(f"TableConfig {self.name!r}: with dynamic ids num_embeddings is the slab capacity: "
                             f"pass None or DynamicIds.capacity={cap}, got {self.num_embeddings!r}")
        if self.init_fn is not None:
            raise ValueError(f"TableConfig {self.name!r}: init_fn cannot be used with dynamic ids (a row is "
                             "created on admission as initial_rows(DynamicIds.seed, id)); drop init_fn")

    @classmethod
    def from_config(cls, config, dynamic: DynamicIds | None = None) -> "TableConfig":
        """A TableConfig from a torchrec `EmbeddingBagConfig` (duck-typed: torchrec is not imported). Empty
        `feature_names` become [name] in `config` itself, as torchrec's EmbeddingBagCollection does. `dynamic`
        makes the table a raw-id table (its num_embeddings must equal dynamic.capacity)."""
        if isinstance(config, cls):
            if dynamic is None or dynamic == config.dynamic:
                return config
            if config.dynamic is not None:
                raise ValueError(f"table {config.name!r}: dynamic given twice (TableConfig.dynamic and the "
                                 "collection's dynamic=); give it once")
            return replace(config, dynamic=dynamic)
        missing = [a for a in ("name", "num_embeddings", "embedding_dim", "feature_names")
                   if not hasattr(config, a)]
        if missing:
            raise TypeError(f"tables must be TableConfig or torchrec EmbeddingBagConfig, got "
                            f"{type(config).__name__} without {missing}")
        pooling = getattr(config, "pooling", "sum")
        pooling = str(getattr(pooling, "value", pooling)).lower()  # torchrec PoolingType.SUM -> "sum"
        data_type = getattr(config, "data_type", None)
        dtype = torch.float32
        if data_type is not None:
            key = str(getattr(data_type, "name", data_type)).upper()
            if key not in DTYPES:
                raise ValueError(f"table {config.name!r}: data_type {key} is not supported; use FP32, FP16 or "
                                 "BF16")
            dtype = DTYPES[key]
        if not config.feature_names:
            config.feature_names = [config.name]
        # A dynamic table's rows are initial_rows(seed, id): torchrec's init_fn (set to its default when not
        # given, so a user's one cannot be told apart) does not apply.
        init_fn = getattr(config, "init_fn", None) if dynamic is None else None
        return cls(config.name, config.num_embeddings, config.embedding_dim, tuple(config.feature_names), pooling,
                   dtype, init_fn, dynamic)

    def table_init(self) -> TableInit:
        """How this table's rows are drawn: `init_fn`, else torchrec's default U(+-sqrt(1 / num_embeddings))."""
        if self.init_fn is not None:
            return TableInit(self.init_fn, elementwise=False)
        return TableInit.uniform(self.num_embeddings)

    def initialize(self, rows: torch.Tensor) -> None:
        """Fill this table's full rows in place with `init_fn` (torchrec's default without one)."""
        with torch.no_grad():
            self.table_init().fill(rows)


__all__ = ["TableConfig", "POOLINGS", "DTYPES", "TABLE_DTYPES"]
