"""Cache sizing before training: miss-ratio curves from id traces, and a device-memory budget split over tables.

Owns the offline side of the cache, nothing on the hot path:

- `simulators`: batch-granular policy simulators (lfu, lru, the look-ahead policy, Belady-OPT, peers' policies);
- `readers`, `shards`: id traces per table from a preprocessed recipe directory, raw id files (`IdFiles`: a
  .npy / .npz per table or a directory of them), model inputs (KeyedJaggedTensor,
  dict, 2-D tensor, (input, offsets)) or arrays, kept whole or spatially sampled (SHARDS);
- `stack_distance`, `curves`: miss-ratio curves (rows moved per batch against cache rows), exact or sampled with
  an error estimate;
- `split`: the budget split (convex-hull relaxation, branch and bound);
- `plan`: traces -> curves -> split -> predictions per table and per shared cache (`plan(...)`);
- `budgets`: the split over a range of budgets, the curve of bytes moved against budget bytes and its knee
  (`plan_range(...)`);
- `report`, `torchrec_stats`: the text table, the PNG, torchrec planner cache statistics; `__main__`: the CLI
  (`python -m cachedemb.sizing --data PATH --budget 8GiB` or `--budget 1MiB:1GiB`).

May import: numpy, torch, `cachedemb.optim` (per-row optimizer state sizes); matplotlib and torchrec lazily.
Nothing of the cache, the modules or the kernels: the collection imports this package (`cache_rows="auto"`), so
it sits below it (docs/sizing.md).
"""
from cachedemb.sizing.budgets import BudgetCurve, BudgetPoint, knee_index, parse_budgets, plan_range
from cachedemb.sizing.curves import POLICIES, MissRatioCurve, WarmStart, default_sizes, miss_ratio_curve
from cachedemb.sizing.plan import (GroupPlan, SizingPlan, TablePlan, TableSpec, parse_bytes, plan, read_traces,
                                   state_cols)
from cachedemb.sizing.readers import IdFiles
from cachedemb.sizing.shards import TableTrace, table_trace
from cachedemb.sizing.split import Split, TableCost, split_budget
from cachedemb.sizing.torchrec_stats import CurveCacheStatistics

__all__ = ["BudgetCurve", "BudgetPoint", "CurveCacheStatistics", "GroupPlan", "IdFiles", "MissRatioCurve", "POLICIES",
           "SizingPlan", "Split", "TableCost", "TablePlan", "TableSpec", "TableTrace", "WarmStart", "default_sizes",
           "knee_index", "miss_ratio_curve", "parse_budgets", "parse_bytes", "plan", "plan_range", "read_traces",
           "split_budget", "state_cols", "table_trace"]
