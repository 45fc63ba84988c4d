"""Draw a cache's per-batch hit rate and rows moved to a PNG.

Input: a JSON history as returned by `CachedEmbeddingBag.cache_history()` (module built with `stats_history=N`),
or `--demo`, which replays a Zipf trace through a module with LFU and with the look-ahead pipeline and draws both.

    python scripts/plot_cache_stats.py history.json --out cache.png
    python scripts/plot_cache_stats.py --demo --out cache.png
"""
from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def hit_rate(history: dict) -> list[float]:
    """Per batch: share of distinct ids served without a host->device transfer."""
    return [1 - r / u if u else float("nan") for r, u in zip(history["rows_in"], history["unique"])]


def rolling_sum(values: list[float], window: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64).cumsum(0)
    return (t - torch.cat([torch.zeros(window), t[:-window]]) if len(values) > window else t).tolist()


def plot(histories: dict[str, dict], out: str, smooth: int = 8) -> None:
    """Rates over a rolling window of `smooth` batches, so window admissions (which land on one batch) and the
    batches they serve are counted together."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, h in histories.items():
        rows, unique = rolling_sum(h["rows_in"], smooth), rolling_sum(h["unique"], smooth)
        top.plot(h["batch"], [1 - r / u if u else float("nan") for r, u in zip(rows, unique)], label=label)
        bottom.plot(h["batch"], [r / min(smooth, i + 1) for i, r in enumerate(rows)], label=label)
    top.set_ylabel("hit rate (1 - rows moved / distinct ids)")
    bottom.set_ylabel("rows moved per batch")
    bottom.set_xlabel("batch")
    top.legend()
    top.set_title(f"cache statistics, rolling {smooth} batches")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def demo_histories(batches: int = 120, num_rows: int = 200_000, lookups: int = 4096) -> dict[str, dict]:
    import cachedemb
    from cachedemb.tools.traces import zipf_trace

    trace = [torch.from_numpy(b) for b in zipf_trace(num_rows, lookups, batches, 1.05, seed=0)]
    offsets = torch.zeros(1, dtype=torch.int64)
    out = {}
    for label, depth in (("lfu", 0), ("lookahead K=4 H=32", 4)):
        emb = cachedemb.CachedEmbeddingBag(num_rows, 4, mode="sum", cache_ratio=0.02, device="cpu",
                                           optimizer=cachedemb.optim.SGD(0.0), stats_history=batches)
        source = cachedemb.prefetch(trace, [emb], depth=depth, horizon=32) if depth else trace
        for ids in source:
            emb(ids, offsets).sum().backward()
        out[label] = emb.cache_history()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("history", nargs="?", help="JSON file: one history dict, or {label: history}")
    p.add_argument("--demo", action="store_true")
    p.add_argument("--out", default="cache_stats.png")
    p.add_argument("--smooth", type=int, default=8, help="rolling window in batches (>= 1)")
    args = p.parse_args(argv)
    if args.demo:
        histories = demo_histories()
    elif args.history:
        with open(args.history) as f:
            data = json.load(f)
        histories = {args.history: data} if "batch" in data else data
    else:
        p.error("give a history JSON file or --demo")
    for label, h in histories.items():
        missing = {"batch", "rows_in", "unique"} - set(h)
        if missing:
            raise SystemExit(f"history {label!r} lacks {sorted(missing)}: expected CachedEmbeddingBag.cache_history()")
    if args.smooth < 1:
        p.error(f"--smooth must be >= 1, got {args.smooth}")
    plot(histories, args.out, args.smooth)
    print(args.out)


if __name__ == "__main__":
    main()
