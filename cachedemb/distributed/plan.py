"""Where each cached table lives in a torchrun job: the sharding plan.

A plan maps a module path in the model (`""` for the model itself, `"emb"`, `"sparse.ebc"`; for a collection,
`"<path>.<table>"`) to a `TableSharding`: the sharding type and, per rank, the contiguous range of rows it
keeps. Three types, as torchrec's:

* table-wise: one rank keeps every row (range [0, N)), the others none;
* row-wise: rows split in contiguous ranges over all ranks (each rank ceil(N / W) rows, the last fewer);
* data-parallel: every rank keeps every row (a replica); the update inputs are exchanged so replicas stay equal.

A plan is printable (`print(plan)`), and round-trips through `to_dict()` / `ShardingPlan.from_dict()` (plain JSON
types), which is how it is saved beside a checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class ShardingType(str, Enum):
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    DATA_PARALLEL = "data_parallel"


@dataclass(frozen=True)
class TableSharding:
    """One table's placement: `ranges[r]` is the [start, end) of the rows rank r keeps (end == start: none)."""

    sharding_type: ShardingType
    num_embeddings: int
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self):
        object.__setattr__(self, "sharding_type", ShardingType(self.sharding_type))
        object.__setattr__(self, "ranges", tuple((int(a), int(b)) for a, b in self.ranges))
        n = self.num_embeddings
        for r, (a, b) in enumerate(self.ranges):
            if not 0 <= a <= b <= n:
                raise ValueError(f"rank {r}'s rows [{a}, {b}) are not inside [0, {n})")
        if self.sharding_type == ShardingType.DATA_PARALLEL:
            if any(rng != (0, n) for rng in self.ranges):
                raise ValueError(f"data-parallel: every rank keeps rows [0, {n}), got {self.ranges}")
        else:
            kept = sorted((a, b) for a, b in self.ranges if b > a)
            covered = 0
            for a, b in kept:
                if a != covered:
                    raise ValueError(f"{self.sharding_type.value}: rank ranges {self.ranges} must tile [0, {n}) "
                                     f"without gaps or overlaps (row {covered} is kept by no rank or by two)")
                covered = b
            if covered != n:
                raise ValueError(f"{self.sharding_type.value}: rank ranges {self.ranges} stop at row {covered}, "
                                 f"the table has {n} rows")

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    def owners(self) -> list[int]:
        """Ranks that keep at least one row."""
        return [r for r, (a, b) in enumerate(self.ranges) if b > a]

    @classmethod
    def table_wise(cls, num_embeddings: int, rank: int, world_size: int) -> "TableSharding":
        if not 0 <= rank < world_size:
            raise ValueError(f"table-wise rank must be in [0, {world_size}), got {rank}")
        ranges = [(0, num_embeddings) if r == rank else (0, 0) for r in range(world_size)]
        return cls(ShardingType.TABLE_WISE, num_embeddings, tuple(ranges))

    @classmethod
    def row_wise(cls, num_embeddings: int, world_size: int) -> "TableSharding":
        """ceil(N / W) rows per rank in rank order (torch.chunk's split; the last ranks may keep fewer or none)."""
        block = math.ceil(num_embeddings / world_size)
        ranges = [(min(r * block, num_embeddings), min((r + 1) * block, num_embeddings)) for r in range(world_size)]
        return cls(ShardingType.ROW_WISE, num_embeddings, tuple(ranges))

    @classmethod
    def data_parallel(cls, num_embeddings: int, world_size: int) -> "TableSharding":
        return cls(ShardingType.DATA_PARALLEL, num_embeddings, tuple((0, num_embeddings) for _ in range(world_size)))

    def describe(self) -> str:
        if self.sharding_type == ShardingType.TABLE_WISE:
            return f"table_wise on rank {self.owners()[0]} ({self.num_embeddings} rows)"
        if self.sharding_type == ShardingType.DATA_PARALLEL:
            return f"data_parallel on {self.world_size} ranks ({self.num_embeddings} rows each)"
        parts = ", ".join(f"r{r}:[{a},{b})" for r, (a, b) in enumerate(self.ranges))
        return f"row_wise {parts}"


@dataclass
class ShardingPlan:
    """Module path -> TableSharding, for one world size."""

    world_size: int
    tables: dict[str, TableSharding] = field(default_factory=dict)

    def __post_init__(self):
        for name, t in self.tables.items():
            if t.world_size != self.world_size:
                raise ValueError(f"plan for {self.world_size} ranks: {name!r} is placed over {t.world_size}")

    def __str__(self) -> str:
        lines = [f"ShardingPlan(world_size={self.world_size})"]
        lines += [f"  {name or '<model>'}: {t.describe()}" for name, t in self.tables.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size,
                "tables": {name: {"sharding_type": t.sharding_type.value, "num_embeddings": t.num_embeddings,
                                  "ranges": [list(r) for r in t.ranges]} for name, t in self.tables.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "ShardingPlan":
        return cls(int(d["world_size"]), {name: TableSharding(t["sharding_type"], int(t["num_embeddings"]),
                                                              tuple(tuple(r) for r in t["ranges"]))
                                          for name, t in d["tables"].items()})


def default_plan(tables: dict[str, tuple[int, int, int, float]], world_size: int) -> ShardingPlan:
    """Balance host bytes and expected lookups. `tables`: path -> (rows, dim, bytes per element, lookups per
    step, 0 when unknown). A table whose cost exceeds a rank's fair share (total / W) is split row-wise;
    the rest go table-wise, largest first, each to the rank with the least cost so far."""
    def cost(rows, dim, elem, lookups):
        return rows * dim * elem + lookups * dim * elem

    total = sum(cost(*t) for t in tables.values())
    load = [0.0] * world_size
    plan: dict[str, TableSharding] = {}
    for name, spec in sorted(tables.items(), key=lambda kv: -cost(*kv[1])):
        c, rows = cost(*spec), spec[0]
        if world_size > 1 and c > total / world_size and rows >= world_size:
            plan[name] = TableSharding.row_wise(rows, world_size)
            load = [x + c / world_size for x in load]
        else:
            rank = min(range(world_size), key=lambda r: (load[r], r))
            plan[name] = TableSharding.table_wise(rows, rank, world_size)
            load[rank] += c
    return ShardingPlan(world_size, {name: plan[name] for name in tables})
