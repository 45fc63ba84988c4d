"""`python -m cachedemb.sizing --data PATH --budget 8GiB`: cache rows per table for a device budget (or the
curve over a range of budgets, with its knee), from a trace of the ids the model will look up.

Prints the plan as a table and the next step (the recipe's flag, the code); `--json` writes it with every
curve, `--png` draws the curves with the chosen sizes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from cachedemb import optim
from cachedemb.sizing import readers
from cachedemb.sizing.budgets import MAX_BUDGETS, parse_budgets, plan_range
from cachedemb.sizing.curves import POLICIES
from cachedemb.sizing.plan import parse_bytes, plan
from cachedemb.sizing.report import budget_flag, format_range, human_bytes

OPTIMIZERS = {"none": None, "sgd": optim.SGD(), "adagrad": optim.Adagrad(), "rowwise_adagrad": optim.RowWiseAdagrad(),
              "adam": optim.Adam()}
#: cachedemb.optim class names of OPTIMIZERS' keys, for the code printed as the next step.
_OPTIM_CODE = {"sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "RowWiseAdagrad", "adam": "Adam"}
#: Tables named in the printed `cache_rows={...}` at most (more: plan.cache_rows or the JSON).
_LITERAL_TABLES = 8

EPILOG = f"""\
inputs (--data), detected by what the path holds:
  a directory preprocessed by the DLRM recipe (metadata.json, train_sparse.npy; or its parent): its train split,
      batches in the recipe's order for --seed, rows and embedding dim from its metadata
  a .npy of ids: one table named by the file stem; [samples] (one id per sample) or [samples, tables]
      (tables <stem>_0, <stem>_1, ...)
  an .npz: one table per array, named by its key (2-D arrays as above)
  a directory of .npy / .npz files: all of them, every table with the same number of samples
  raw ids are non-negative integers, batched --batch-size samples at a time in file order; rows per table are
  max id + 1 unless --num-rows gives them; --embedding-dim is needed (the bytes per row)

budgets (--budget):
  8GiB            one budget (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; a bare number is bytes)
  1MiB:1GiB       a range: 1MiB, 2MiB, 4MiB, ... doubling, up to 1GiB
  1MiB:1GiB:12    a range of 12 budgets evenly spaced in log scale (at most {MAX_BUDGETS})
  64MiB,256MiB,1GiB   a list
  a range prints the predicted hit rate and host->device (PCIe) bytes per step at each budget and marks the
  knee: on the curve of PCIe bytes per step against log2(budget), both scaled to [0, 1], the budget farthest
  below the straight line from the first budget to the last (where more budget stops paying); the plan and the
  next step are then for the knee's budget (docs/sizing.md)

examples:
  python -m cachedemb.sizing --data data/criteo-kaggle/preprocessed --budget 8GiB --batch-size 16384
  python -m cachedemb.sizing --data user_ids.npy --embedding-dim 64 --batch-size 4096 --budget 256MiB
  python -m cachedemb.sizing --data ids.npz --embedding-dim 64 --num-rows user=1000000,item=50000 --budget 1GiB
  python -m cachedemb.sizing --data ids/ --embedding-dim 64 --budget 16MiB:4GiB --png sizing.png --json plan.json
"""


class _Help(argparse.RawDescriptionHelpFormatter):
    """Raw description and epilog, and each option's default where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "%(default)" not in text and "default" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cachedemb.sizing", description=__doc__.split("\n\n")[0],
                                formatter_class=_Help, epilog=EPILOG)
    p.add_argument("--data", required=True, metavar="PATH",
                   help="the ids: a recipe-preprocessed directory, a .npy / .npz of ids, or a directory of them "
                        "(see inputs below)")
    p.add_argument("--budget", required=True, metavar="SIZE|LO:HI[:N]|A,B,...",
                   help="device bytes for all the caches: one size, a range or a list (see budgets below)")
    p.add_argument("--num-rows", default=None, metavar="N|TABLE=N,...",
                   help="raw ids: rows per table, one number for every table or TABLE=N pairs (default: each "
                        "table's max id + 1)")
    p.add_argument("--embedding-dim", type=int, default=None, metavar="DIM",
                   help="values per row (default: the recipe directory's; needed for raw ids)")
    p.add_argument("--batch-size", type=int, default=16384, metavar="N", help="samples per training step")
    p.add_argument("--policy", choices=POLICIES, default="lfu",
                   help="the policy the module runs: lfu, lookahead (under cachedemb.prefetch), lru, opt (Belady, "
                        "the floor)")
    p.add_argument("--depth", type=int, default=4,
                   metavar="N", help="lookahead: batches admitted at once (prefetch depth)")
    p.add_argument("--horizon", type=int, default=64, metavar="N", help="lookahead: batches of ids seen ahead")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="lookahead: the next window is admitted during the current one (cachedemb.prefetch's "
                        "default; --no-overlap for prefetch(..., overlap=False))")
    p.add_argument("--compare", default="lfu,lru,lookahead,opt", metavar="POLICIES",
                   help="policies whose curves are also drawn and written (comma-separated; '' for none)")
    p.add_argument("--limit-batches", type=int, default=None, metavar="N", help="size from the first N batches")
    p.add_argument("--seed", type=int, default=0,
                   metavar="N", help="recipe directory: the recipe's --seed (its batch order)")
    p.add_argument("--epoch", type=int, default=0,
                   metavar="N", help="recipe directory: the epoch whose batch order to use")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad",
                   help="the fused optimizer: its state moves with each row")
    p.add_argument("--no-warm-start", action="store_true",
                   help="recipe directory: the module gets no id_freq (the recipe passes the train counts: LFU "
                        "seeded, the hottest rows preloaded); raw ids never have one")
    p.add_argument("--warmup-ratio", type=float, default=0.7,
                   metavar="R", help="warm start: share of each cache preloaded")
    p.add_argument("--per-table-caches", action="store_true",
                   help="one cache per table (standalone modules) instead of the collection's shared groups")
    p.add_argument("--host-budget", default=None,
                   metavar="SIZE", help="host bytes for host caches in front of a file tier")
    p.add_argument("--min-rows", default="batch", metavar="batch|N",
                   help="least rows per table's cache: 'batch' (its largest batch's distinct ids) or a number")
    p.add_argument("--sample-rate", type=float, default=1.0,
                   metavar="R", help="SHARDS: keep this fraction of the id space")
    p.add_argument("--max-unique", default="auto", metavar="auto|none|N",
                   help="SHARDS: sample a table whose kept per-batch distinct ids pass this (auto: 2^20; none)")
    p.add_argument("--points", type=int, default=24, metavar="N", help="curve sizes per table")
    p.add_argument("--json", default=None, metavar="PATH", help="write the plan and every curve here ('-': stdout)")
    p.add_argument("--png", default=None, metavar="PATH", help="draw the curves and the chosen sizes here")
    return p


def _num_rows(text: str):
    if "=" not in text:
        return int(text)
    out = {}
    for part in text.split(","):
        name, _, rows = part.partition("=")
        out[name.strip()] = int(rows)
    return out


def parse_args(argv, p: argparse.ArgumentParser | None = None):
    p = p or build_parser()
    args = p.parse_args(argv)
    if args.png and importlib.util.find_spec("matplotlib") is None:  # refused before minutes of simulation
        p.error(f"--png {args.png}: drawing needs matplotlib, which is not installed (pip install matplotlib)")
    try:
        args.budgets = parse_budgets(args.budget)
    except ValueError as e:
        p.error(f"--budget: {e}")
    try:
        args.host_budget_bytes = None if args.host_budget is None else parse_bytes(args.host_budget)
    except ValueError as e:
        p.error(f"--host-budget: {e}")
    args.budget_bytes = args.budgets[0] if len(args.budgets) == 1 else args.budgets
    args.compare = tuple(c for c in args.compare.split(",") if c)
    bad = [c for c in args.compare if c not in POLICIES]
    if bad:
        p.error(f"--compare: unknown policies {bad}; expected some of {POLICIES}")
    try:
        args.num_rows = None if args.num_rows is None else _num_rows(args.num_rows)
    except ValueError:
        p.error(f"--num-rows {args.num_rows!r}: expected a number (every table) or TABLE=N pairs, e.g. a=1000,b=50")
    try:
        args.min_rows = "batch" if args.min_rows == "batch" else int(args.min_rows)
    except ValueError:
        p.error(f"--min-rows {args.min_rows!r}: expected 'batch' or a number of rows")
    mu = args.max_unique.lower()
    args.max_unique = "auto" if mu == "auto" else None if mu == "none" else int(mu)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return args


def _source_words(args, data, result) -> list[str]:
    """What was read, how it was batched, and where each table's rows came from."""
    t0 = result.tables[0].curve
    batches = f"{t0.num_batches} batches of {args.batch_size} samples"
    if isinstance(data, readers.DataDir):
        lines = [f"ids: {data.path} (DLRM recipe, train split), {len(data.table_names)} tables, {batches} in the "
                 f"recipe's order for --seed {args.seed}; rows per table from its metadata.json"]
    else:
        given = [n for n in data.table_names if data.rows_given[n]]
        rows = ("rows per table: given by --num-rows" if len(given) == len(data.table_names) else
                "rows per table: max id + 1 (inferred; --num-rows sets them)" if not given else
                f"rows per table: given by --num-rows for {', '.join(given)}, max id + 1 (inferred) for the rest")
        lines = [f"ids: {data.path} (raw ids), {len(data.table_names)} tables, {data.num_samples} samples -> "
                 f"{batches} in file order; {rows}"]
    if t0.num_batches == 1:
        lines.append("note: a single batch: every id moves once whatever the cache, so the curve is flat; lower "
                     "--batch-size (samples per step) or give more samples")
    return lines


def next_step(args, data, result) -> tuple[str, dict]:
    """The printed next step for ``result``'s budget (the recipe's flag for a recipe directory; the code), and
    the same as data for the JSON."""
    flag = budget_flag(result.budget_bytes)
    rows = result.cache_rows
    opt = (f"cachedemb.optim.{_OPTIM_CODE[args.optimizer]}(...)" if args.optimizer in _OPTIM_CODE else "None")
    src = f"cachedemb.sizing.IdFiles({str(args.data)!r}, num_rows={args.num_rows!r})" \
        if isinstance(data, readers.IdFiles) and args.num_rows is not None else repr(str(args.data))
    dim = f", embedding_dim={args.embedding_dim}" if isinstance(data, readers.IdFiles) else ""
    lines = [f"next step, for a budget of {human_bytes(result.budget_bytes)}:"]
    recipe = None
    if isinstance(data, readers.DataDir):
        extra = (f" --prefetch-depth {args.depth} --prefetch-horizon {args.horizon}" if args.policy == "lookahead"
                 else "")
        recipe = f"--cache-budget {flag}{extra}"
        lines.append(f"  DLRM recipe: python -m cachedemb.recipes.dlrm.main ... {recipe}")
        lines.append(f"               (it sizes its caches this way at start-up; keep --batch-size {args.batch_size} "
                     f"--seed {args.seed} and --optimizer {args.optimizer} as here)")
        if args.policy not in ("lfu", "lookahead"):
            lines.append(f"               the recipe runs lfu (or lookahead with --prefetch-depth), not "
                         f"{args.policy}: re-run with --policy lfu for its figures")
    budget = flag if flag.isdigit() else repr(flag)
    look = f", depth={args.depth}, horizon={args.horizon}" if args.policy == "lookahead" else ""
    lines.append(f"  in code:     plan = cachedemb.sizing.plan({src}, {budget}{dim}, batch_size={args.batch_size}, "
                 f"optimizer={opt}, policy={args.policy!r}{look})")
    lines.append("               ebc = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows=plan.cache_rows, "
                 "optimizer=...)")
    if len(rows) <= _LITERAL_TABLES:
        lines.append(f"               or directly cache_rows={json.dumps(rows)}")
    else:
        lines.append(f"               ({len(rows)} tables: the rows per table are also in --json's next_step.cache_rows)")
    lines.append("               (tables: a cachedemb.TableConfig per table, named as above)")
    if args.policy == "lookahead":
        lines.append(f"               and train under cachedemb.prefetch(loader, [ebc], depth={args.depth}, "
                     f"horizon={args.horizon})")
    return "\n".join(lines), {"budget_bytes": result.budget_bytes, "recipe_flags": recipe, "cache_rows": rows}


def main(argv=None) -> dict:
    p = build_parser()
    args = parse_args(argv, p)
    try:
        data = readers.open_path(args.data, args.num_rows)
        if isinstance(data, readers.IdFiles) and args.embedding_dim is None:
            raise ValueError(f"{args.data!r} holds raw ids, which do not record the embedding dim: pass "
                             "--embedding-dim (the values per row, for the bytes each row costs)")
        kw = dict(optimizer=OPTIMIZERS[args.optimizer], policy=args.policy, horizon=args.horizon, depth=args.depth,
                  overlap=args.overlap, compare=args.compare, groups=None if args.per_table_caches else "collection",
                  id_freq=None if args.no_warm_start else "auto", warmup_ratio=args.warmup_ratio,
                  host_budget_bytes=args.host_budget_bytes, min_rows=args.min_rows,
                  embedding_dim=args.embedding_dim, points=args.points, batch_size=args.batch_size,
                  limit_batches=args.limit_batches, seed=args.seed, epoch=args.epoch, sample_rate=args.sample_rate,
                  max_unique=args.max_unique)
        if len(args.budgets) == 1:
            curve, result = None, plan(data, args.budgets[0], **kw)
            report = result.to_dict()
        else:
            curve = plan_range(data, args.budgets, **kw)
            result = curve.chosen_plan
            report = curve.to_dict()
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    step_text, step = next_step(args, data, result)
    report["next_step"] = step
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "png")}
    if args.json != "-":
        print("\n".join(_source_words(args, data, result)))
        print()
        if curve is not None:
            print(format_range(curve))
            print()
            print(f"the plan for {human_bytes(result.budget_bytes)}:")
        print(result.format_table())
        print()
        print(step_text)
    if args.json:
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    sys.stdout.flush()
    if args.png:
        result.plot(args.png, curve)
        print(f"curves drawn to {args.png}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
