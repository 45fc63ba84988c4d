"""What people look at: the plan as a text table, and a PNG of the curves with the chosen sizes marked.
matplotlib is imported only to draw (it is in the `test` extra, not a dependency)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_table(plan) -> str:
    """One line per table (rows, share of the table, predicted hit rate, rows moved and PCIe bytes per step),
    one per shared cache, and the totals."""
    head = (f"{'table':<20} {'rows':>12} {'cache_rows':>11} {'ratio':>8} {'hit rate':>9} {'rows/step':>11} "
            f"{'PCIe/step':>12} {'device':>11}")
    lines = [f"policy {plan.policy}" + "".join(f", {k} {v}" for k, v in plan.options.items())
             + f"; budget {human_bytes(plan.budget_bytes)}, used {human_bytes(plan.budget_used)}", head,
             "-" * len(head)]
    for t in plan.tables:
        n = t.spec.num_embeddings
        ratio = f"{t.cache_rows / n:8.4f}" if n else f"{'-':>8}"
        sampled = f" (±{t.curve.max_stderr:.3f})" if t.curve.stderr is not None else ""
        lines.append(f"{t.name:<20} {n if n else '-':>12} {t.cache_rows:>11} {ratio} {t.hit_rate:>9.4f} "
                     f"{t.rows_per_batch:>11.1f} {human_bytes(t.pcie_bytes_per_step):>12} "
                     f"{human_bytes(t.device_bytes):>11}{sampled}")
    shared = [g for g in plan.groups if len(g.tables) > 1]
    if shared:
        lines.append("")
        lines.append("shared caches (a collection group: its tables' rows summed, simulated on their merged trace)")
        for g in shared:
            lines.append(f"  {', '.join(g.tables[:4]) + (', ...' if len(g.tables) > 4 else ''):<40} "
                         f"rows {g.cache_rows:>10}  hit rate {g.hit_rate:.4f}  rows/step {g.rows_per_batch:.1f}  "
                         f"PCIe/step {human_bytes(g.pcie_bytes_per_step)}")
    split = plan.split
    lines.append("")
    lines.append(f"predicted: hit rate {plan.hit_rate:.4f}, PCIe {human_bytes(plan.pcie_bytes_per_step)} per step "
                 f"(split objective {human_bytes(split.bytes_moved)}, bound {human_bytes(split.lower_bound)}, "
                 f"{'optimal' if split.optimal else 'node limit hit'})")
    if plan.host_split is not None:
        lines.append(f"host caches ({human_bytes(plan.host_budget_bytes)}): "
                     + ", ".join(f"{t.name} {t.host_rows}" for t in plan.tables)
                     + f"; file reads {human_bytes(sum(t.file_bytes_per_step for t in plan.tables))} per step")
    return "\n".join(lines)


def plot(plan, path) -> Path:
    """A grid of per-table panels: miss ratio against cache rows (log scale) for every policy computed, the
    chosen size marked; sampled curves with their standard error as a band."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    tables = plan.tables
    cols = min(4, len(tables))
    rows = -(-len(tables) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    styles = {"lfu": "C0", "lru": "C1", "lookahead": "C2", "opt": "k"}
    for ax, t in zip(axes.flat, tables):
        for name, c in t.curves.items():
            x = np.maximum(c.sizes, 1)
            ax.plot(x, c.miss_ratio, color=styles.get(name), lw=1.5 if name == t.policy else 1,
                    ls="--" if name == "opt" else "-", label=name)
            if c.stderr is not None:
                ax.fill_between(x, c.miss_ratio - c.stderr, c.miss_ratio + c.stderr, color=styles.get(name),
                                alpha=0.2, lw=0)
        ax.plot([max(t.cache_rows, 1)], [t.miss_ratio], "o", color="C3", ms=6,
                label=f"chosen: {t.cache_rows} rows")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_title(t.name, fontsize=9)
        ax.set_xlabel("cache rows", fontsize=8)
        ax.set_ylabel("rows moved / distinct ids", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tables):]:
        ax.axis("off")
    fig.suptitle(f"miss-ratio curves, policy {plan.policy}; budget {human_bytes(plan.budget_bytes)}: predicted hit "
                 f"rate {plan.hit_rate:.3f}, PCIe {human_bytes(plan.pcie_bytes_per_step)}/step", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.2 * rows)))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["format_table", "human_bytes", "plot"]
