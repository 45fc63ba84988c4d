"""`python -m cachedemb.sizing --data DIR --budget 8GiB --policy lookahead`: cache rows per table for a device
budget, from a preprocessed DLRM recipe directory's training trace (in the order the recipe trains it).

Prints the plan as a table; `--json` writes it with every curve, `--png` draws the curves with the chosen sizes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachedemb import optim
from cachedemb.sizing.curves import POLICIES
from cachedemb.sizing.plan import parse_bytes, plan

OPTIMIZERS = {"none": None, "sgd": optim.SGD(), "adagrad": optim.Adagrad(), "rowwise_adagrad": optim.RowWiseAdagrad(),
              "adam": optim.Adam()}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m cachedemb.sizing", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a directory preprocessed by the DLRM recipe (or its parent)")
    p.add_argument("--budget", required=True, help="device bytes for the caches, e.g. 8GiB, 512MB")
    p.add_argument("--policy", choices=POLICIES, default="lfu",
                   help="the policy the module runs: lfu (default), lookahead (under cachedemb.prefetch), lru, "
                        "opt (Belady, the floor)")
    p.add_argument("--depth", type=int, default=4, help="look-ahead: batches admitted at once (prefetch depth)")
    p.add_argument("--horizon", type=int, default=64, help="look-ahead: batches of ids seen ahead")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="look-ahead: the next window is admitted during the current one (cachedemb.prefetch's "
                        "default; --no-overlap for prefetch(..., overlap=False))")
    p.add_argument("--compare", default="lfu,lru,lookahead,opt",
                   help="policies whose curves are also drawn and written (comma-separated; '' for none)")
    p.add_argument("--batch-size", type=int, default=16384, help="training batch size (rows per step)")
    p.add_argument("--limit-batches", type=int, default=None, help="size from the first N batches of the epoch")
    p.add_argument("--seed", type=int, default=0, help="the recipe's --seed (its batch order)")
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--embedding-dim", type=int, default=None, help="default: the data directory's")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad",
                   help="the fused optimizer: its state moves with each row")
    p.add_argument("--no-warm-start", action="store_true",
                   help="the module gets no id_freq (the recipe passes the train counts: LFU seeded, the hottest "
                        "rows preloaded)")
    p.add_argument("--warmup-ratio", type=float, default=0.7)
    p.add_argument("--per-table-caches", action="store_true",
                   help="one cache per table (standalone modules) instead of the collection's shared groups")
    p.add_argument("--host-budget", default=None, help="host bytes for host caches in front of a file tier")
    p.add_argument("--min-rows", default="batch",
                   help="least rows per table's cache: 'batch' (its largest batch's distinct ids) or a number")
    p.add_argument("--sample-rate", type=float, default=1.0, help="SHARDS: keep this fraction of the id space")
    p.add_argument("--max-unique", default="auto",
                   help="SHARDS: sample a table whose kept per-batch distinct ids pass this (auto: 2^20; none)")
    p.add_argument("--points", type=int, default=24, help="curve sizes per table")
    p.add_argument("--json", default=None, help="write the plan and every curve here ('-': stdout)")
    p.add_argument("--png", default=None, help="draw the curves and the chosen sizes here")
    args = p.parse_args(argv)
    args.budget_bytes = parse_bytes(args.budget)
    args.host_budget_bytes = None if args.host_budget is None else parse_bytes(args.host_budget)
    args.compare = tuple(c for c in args.compare.split(",") if c)
    bad = [c for c in args.compare if c not in POLICIES]
    if bad:
        p.error(f"--compare: unknown policies {bad}; expected some of {POLICIES}")
    args.min_rows = "batch" if args.min_rows == "batch" else int(args.min_rows)
    mu = args.max_unique.lower()
    args.max_unique = "auto" if mu == "auto" else None if mu == "none" else int(mu)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = plan(args.data, args.budget_bytes, optimizer=OPTIMIZERS[args.optimizer], policy=args.policy,
                  horizon=args.horizon, depth=args.depth, overlap=args.overlap, compare=args.compare,
                  groups=None if args.per_table_caches else "collection",
                  id_freq=None if args.no_warm_start else "auto", warmup_ratio=args.warmup_ratio,
                  host_budget_bytes=args.host_budget_bytes, min_rows=args.min_rows, embedding_dim=args.embedding_dim,
                  points=args.points,
                  batch_size=args.batch_size, limit_batches=args.limit_batches, seed=args.seed, epoch=args.epoch,
                  sample_rate=args.sample_rate, max_unique=args.max_unique)
    report = result.to_dict()
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "png")}
    if args.json != "-":
        print(result.format_table())
    if args.json:
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.png:
        result.plot(args.png)
        print(f"curves drawn to {args.png}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
