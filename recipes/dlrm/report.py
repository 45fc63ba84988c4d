"""The end of a run: the cache hit rate from cache_stats(), a short summary for people, the metrics as JSON for
scripts (full precision; the summary rounds)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .progress import clock


def hit_rate(stats: dict) -> float:
    """Share of each batch's distinct ids found in the cache: `cache_stats()["hit_rate"]` where the cache reports
    it, else 1 - rows_in / unique (rows moved host->device, so window admissions under prefetch are not hidden);
    NaN before any lookup."""
    if stats.get("hit_rate") is not None:
        return float(stats["hit_rate"])
    unique = stats.get("unique", 0)
    return 1.0 - stats.get("rows_in", 0) / unique if unique else float("nan")


def _num(x, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_summary(metrics: dict, metrics_file: str | None = None) -> str:
    """A few aligned lines: what ran, AUC / logloss / accuracy, samples/s, hit rate, rows moved, time."""
    m = metrics
    epochs = m.get("epochs", 0)
    ranks = f" on {m['world_size']} ranks" if m.get("world_size", 1) > 1 else ""
    head = (f"DLRM on {m['data']}: {epochs} epoch{'s' if epochs != 1 else ''}, {m['steps']:,} steps of "
            f"{m['batch_size']:,} samples, cache ratio {m['cache_ratio']:.4g}, {m['device']}{ranks}")
    rows = []
    if "auc" in m:
        rows += [("AUC", _num(m["auc"], ".4f"), ""), ("logloss", _num(m["logloss"], ".4f"), ""),
                 ("accuracy", _num(m["accuracy"], ".4f"), f"{m['eval_rows']:,} val samples")]
    else:
        rows.append(("AUC", "n/a", f"not evaluated: stopped after step {m['steps']}"))
    rows += [("samples/s", _num(m["samples_per_s"], ",.0f"), f"{m['train_samples']:,} train samples"),
             ("hit rate", _num(m["cache_hit_rate"], ".3f"), "distinct ids of a batch found in the cache")]
    if "predicted_cache_hit_rate" in m:
        rows.append(("predicted", _num(m["predicted_cache_hit_rate"], ".3f"),
                     f"hit rate of the --cache-budget plan ({m['cache_budget_bytes'] / 2**20:,.1f} MiB)"))
    rows += [("rows moved", f"{m['cache_rows_in']:,}", "host->device"),
             ("time", clock(m["train_time_s"]), "training")]
    width = max(len(v) for _, v, _ in rows)
    lines = [head] + [f"  {k:<11} {v:<{width}}" + (f"  ({note})" if note else "") for k, v, note in rows]
    if metrics_file not in (None, "-"):
        lines.append(f"  {'metrics':<11} {metrics_file}  (JSON, full precision)")
    return "\n".join(line.rstrip() for line in lines)


def to_json(metrics: dict, indent: int | None = None) -> str:
    """Strict JSON (NaN -> null), keys in the order they were added."""
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
    return json.dumps(clean, indent=indent, allow_nan=False)


def publish(metrics: dict, metrics_file: str | None) -> None:
    """The summary on stdout and the JSON in `metrics_file`; with '-', the JSON line on stdout and the summary on
    stderr."""
    if metrics_file == "-":
        print(format_summary(metrics, metrics_file), file=sys.stderr, flush=True)
        print(to_json(metrics), flush=True)
        return
    if metrics_file is not None:
        path = Path(metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_json(metrics, indent=2) + "\n")
    print(format_summary(metrics, metrics_file), flush=True)
