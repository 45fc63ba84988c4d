"""What people look at: the plan as a text table in plain words, the budget range as a table with its knee, and
a PNG of the curves with the chosen sizes marked. matplotlib is imported only to draw (it is in the `test`
extra, not a dependency)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

#: A table gets its own panel unless it is under both shares: of the budget, and of the bytes moved per step.
SMALL_SHARE = 0.01
#: At most this many table panels (with "other", two full rows of four); the rest join the "other" panel.
MAX_PANELS = 7
_STYLES = {"lfu": ("C0", "-"), "lru": ("C1", "-"), "lookahead": ("C2", "-"), "opt": ("k", "--")}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def budget_flag(n: int) -> str:
    """``n`` bytes as the shortest size `parse_bytes` reads back exactly (``512MiB``, ``3GB``, ``1000001``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("TB", 10**12),
                        ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(int(n))


def _policy_words(plan) -> str:
    o = plan.options
    words = {"lfu": "lfu (least frequently used, the module's default)", "lru": "lru (least recently used)",
             "opt": "opt (Belady: the best any cache could do)",
             "lookahead": "lookahead (cachedemb.prefetch"}[plan.policy]
    if plan.policy == "lookahead":
        words += (f": ids seen {o['horizon']} batches ahead, up to {o['depth']} batches admitted at once"
                  f"{', the next window during this one' if o['overlap'] else ''})")
    if "warmup_ratio" in o:
        words += (f"; warm start: each cache preloaded to {o['warmup_ratio']:.0%} with the ids the train counts rank "
                  "hottest")
    return words


def split_words(split) -> str:
    """The split's result and how close it is to the best possible, in plain words."""
    found, bound = split.bytes_moved, split.lower_bound
    gap = (found - bound) / found if found > 0 else 0.0
    head = f"split found: {human_bytes(found)} of predicted misses per step (each table's own cache)"
    if not split.optimal:
        return (f"{head}; the search stopped at its node limit, so a better split may exist: none can do better "
                f"than {human_bytes(bound)} (within {gap:.2%})")
    if gap < 1e-6:
        return f"{head}; no split of this budget can do better"
    return f"{head}; no split can do better than {human_bytes(bound)} (within {gap:.2%})"


def format_table(plan) -> str:
    """One line per table (rows, share of the table, predicted hit rate, rows moved and PCIe bytes per step),
    one per shared cache, and the totals, in plain words."""
    head = (f"{'table':<20} {'rows':>12} {'cache rows':>11} {'of table':>8} {'hit rate':>9} {'rows in/step':>12} "
            f"{'PCIe/step':>12} {'device mem':>11}")
    lines = [f"policy {_policy_words(plan)}",
             f"budget {human_bytes(plan.budget_bytes)}, of which the caches use {human_bytes(plan.budget_used)}",
             "", head, "-" * len(head)]
    for t in plan.tables:
        n = t.spec.num_embeddings
        ratio = f"{t.cache_rows / n:8.2%}" if n else f"{'-':>8}"
        sampled = f" (±{t.curve.max_stderr:.3f}, sampled)" if t.curve.stderr is not None else ""
        lines.append(f"{t.name:<20} {n if n else '-':>12} {t.cache_rows:>11} {ratio} {t.hit_rate:>9.4f} "
                     f"{t.rows_per_batch:>12.1f} {human_bytes(t.pcie_bytes_per_step):>12} "
                     f"{human_bytes(t.device_bytes):>11}{sampled}")
    shared = [g for g in plan.groups if len(g.tables) > 1]
    if shared:
        lines.append("")
        lines.append("shared caches (a collection keeps one cache per embedding dim: its tables' rows summed, "
                     "predicted on their merged ids)")
        for g in shared:
            lines.append(f"  {', '.join(g.tables[:4]) + (', ...' if len(g.tables) > 4 else ''):<40} "
                         f"rows {g.cache_rows:>10}  hit rate {g.hit_rate:.4f}  rows in/step {g.rows_per_batch:.1f}  "
                         f"PCIe/step {human_bytes(g.pcie_bytes_per_step)}")
    lines.append("")
    lines.append(f"predicted: hit rate {plan.hit_rate:.4f}, {human_bytes(plan.pcie_bytes_per_step)} host->device "
                 "per step (rows moved into the caches x bytes per row)")
    lines.append(split_words(plan.split))
    if plan.host_split is not None:
        lines.append(f"host caches ({human_bytes(plan.host_budget_bytes)}): "
                     + ", ".join(f"{t.name} {t.host_rows}" for t in plan.tables)
                     + f"; file reads {human_bytes(sum(t.file_bytes_per_step for t in plan.tables))} per step")
    return "\n".join(lines)


def format_range(curve) -> str:
    """The budget range: one line per budget (rows per step and hit rate, the share of the range's savings),
    the knee marked, and what the range left out."""
    pts = curve.points
    first, last = pts[0].pcie_bytes_per_step, pts[-1].pcie_bytes_per_step
    span = first - last
    head = f"  {'budget':>12} {'used':>12} {'hit rate':>9} {'PCIe/step':>12} {'saved':>7}"
    shared = any(len(g.tables) > 1 for g in curve.plans[0].groups)
    if shared:
        head += f"   {'shared caches: hit rate':>24} {'PCIe/step':>12}"
    lines = ["budget range: the split at each budget (PCIe/step: host->device bytes per step predicted for each "
             "table's own cache; saved: share of the range's drop reached)", head, "-" * len(head)]
    for k, p in enumerate(pts):
        saved = f"{(first - p.pcie_bytes_per_step) / span:7.0%}" if span > 0 else f"{'-':>7}"
        line = (f"  {human_bytes(p.budget_bytes):>12} {human_bytes(p.budget_used):>12} "
                f"{p.hit_rate:>9.4f} {human_bytes(p.pcie_bytes_per_step):>12} {saved}")
        if shared:
            line += f"   {p.shared_hit_rate:>24.4f} {human_bytes(p.shared_pcie_bytes_per_step):>12}"
        lines.append(line + ("   <- knee" if k == curve.knee else ""))
    lines.append("")
    if curve.knee is not None:
        k = pts[curve.knee]
        lines.append(f"knee: {human_bytes(k.budget_bytes)}, the budget where the curve of PCIe bytes per "
                     "step against log2(budget) bends most (farthest below the straight line from the first budget "
                     f"to the last); it reaches {(first - k.pcie_bytes_per_step) / span:.0%} of the range's saving")
    else:
        lines.append("no knee in this range: the bytes fall at least as fast at its top end (or it holds under "
                     "three budgets that fit); try a wider range. The plan below is for the largest budget")
    if curve.too_small:
        lines.append(f"left out, below the smallest caches the tables allow ({human_bytes(curve.least_bytes)}): "
                     + ", ".join(human_bytes(b) for b in curve.too_small))
    if pts[-1].budget_bytes >= curve.whole_bytes:
        lines.append(f"every distinct id fits from {human_bytes(curve.whole_bytes)}: larger budgets change nothing")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the PNG


def _is_small(t, plan) -> bool:
    total = sum(u.pcie_bytes_per_step for u in plan.tables) or 1.0
    return t.device_bytes < SMALL_SHARE * plan.budget_bytes and t.pcie_bytes_per_step < SMALL_SHARE * total


def _panels(plan) -> tuple[list, list]:
    """Tables with a panel of their own (by bytes moved, most first) and the rest ("other"): the small ones
    (under `SMALL_SHARE` of the budget and of the bytes moved) and those past `MAX_PANELS`."""
    big, small = [], []
    for t in sorted(plan.tables, key=lambda t: -t.pcie_bytes_per_step):
        (small if _is_small(t, plan) or len(big) >= MAX_PANELS else big).append(t)
    return big, small


def _table_panel(ax, t, handles) -> None:
    for name, c in t.curves.items():
        color, ls = _STYLES.get(name, (None, "-"))
        x = np.maximum(c.sizes, 1)
        (line,) = ax.plot(x, c.miss_ratio, color=color, ls=ls, lw=1.6 if name == t.policy else 1)
        handles.setdefault(f"{name}" + (" (the plan's policy)" if name == t.policy else ""), line)
        if c.stderr is not None:
            ax.fill_between(x, c.miss_ratio - c.stderr, c.miss_ratio + c.stderr, color=color, alpha=0.2, lw=0)
    (dot,) = ax.plot([max(t.cache_rows, 1)], [t.miss_ratio], "o", color="C3", ms=6)
    handles.setdefault("chosen cache rows", dot)
    n = t.spec.num_embeddings
    share = f" ({t.cache_rows / n:.1%})" if n else ""
    ax.set_title(f"{t.name}: {t.cache_rows:,} of {n:,} rows{share}" if n else f"{t.name}: {t.cache_rows:,} rows",
                 fontsize=8.5)


def _other_panel(ax, small, plan) -> None:
    for t in small:
        c = t.curve
        ax.plot(np.maximum(c.sizes, 1), c.miss_ratio, color="0.55", lw=0.8)
        ax.plot([max(t.cache_rows, 1)], [t.miss_ratio], "o", color="C3", ms=3)
    budget = sum(t.device_bytes for t in small) / max(plan.budget_bytes, 1)
    moved = sum(t.pcie_bytes_per_step for t in small) / max(sum(t.pcie_bytes_per_step for t in plan.tables), 1e-12)
    kind = "small" if all(_is_small(t, plan) for t in small) else "more"
    plural = "s" if len(small) > 1 else ""
    ax.set_title(f"other: {len(small)} {kind} table{plural}\n{budget:.1%} of the budget, {moved:.1%} of the bytes "
                 "moved", fontsize=8.5)


def _range_panel(ax, curve, handles) -> None:
    pts = curve.points
    x = np.array([p.budget_bytes for p in pts], dtype=np.float64)
    y = np.array([p.pcie_bytes_per_step for p in pts])
    scale, unit = 1.0, "B"
    for u, s in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if y.max(initial=0) >= s:
            scale, unit = s, u
    (pcie,) = ax.plot(x, y / scale, "o-", color="C0", ms=4, lw=1.6)
    handles["PCIe bytes per step (left axis)"] = pcie
    ax.set_ylabel(f"host->device {unit} per step", fontsize=8)
    ax.set_ylim(bottom=0)
    hit = ax.twinx()
    (hr,) = hit.plot(x, [p.hit_rate for p in pts], "s--", color="C2", ms=3, lw=1)
    handles["hit rate (right axis)"] = hr
    hit.set_ylim(0, 1.02)
    hit.set_ylabel("hit rate", fontsize=8)
    hit.tick_params(labelsize=7)
    if curve.knee is not None:
        k = pts[curve.knee]
        (star,) = ax.plot([k.budget_bytes], [k.pcie_bytes_per_step / scale], "*", color="C3", ms=15, zorder=5)
        handles["knee (the budget chosen)"] = star
        ax.annotate(f"knee {human_bytes(k.budget_bytes)}", (k.budget_bytes, k.pcie_bytes_per_step / scale),
                    xytext=(8, 8), textcoords="offset points", fontsize=8, color="C3")
    if curve.whole_bytes <= x.max():
        whole = ax.axvline(curve.whole_bytes, color="0.5", ls=":", lw=1)
        handles["every distinct id fits"] = whole
    ax.set_xscale("log", base=2)
    ax.set_xticks(x if x.size <= 12 else x[:: -(-x.size // 12)])
    ax.set_xticklabels([human_bytes(b).replace(".00", "") for b in ax.get_xticks()], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("device budget for the caches", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.set_title("predicted bytes moved and hit rate against the budget", fontsize=9)


def plot(plan, path, curve=None) -> Path:
    """One panel per table that matters (miss ratio against cache rows, log scale, every policy computed, the
    chosen size marked), the small tables together in one panel, one legend for the figure; with a budget
    range (``curve``, a `budgets.BudgetCurve` whose chosen plan is ``plan``) a first panel of bytes moved and
    hit rate against the budget, the knee marked."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    big, small = _panels(plan)
    n = len(big) + (1 if small else 0)
    cols = min(4, n)
    rows = -(-n // cols)
    top = 1 if curve is not None else 0
    fig = plt.figure(figsize=(max(4.0 * cols, 9.0), 2.9 * rows + 3.2 * top + 0.9), layout="constrained")
    grid = fig.add_gridspec(rows + top, cols, height_ratios=[1.15] * top + [1] * rows)
    handles: dict = {}
    if curve is not None:
        _range_panel(fig.add_subplot(grid[0, :]), curve, handles)
    axes = [fig.add_subplot(grid[top + k // cols, k % cols]) for k in range(n)]
    for ax, t in zip(axes, big):
        _table_panel(ax, t, handles)
    if small:
        _other_panel(axes[-1], small, plan)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for k, ax in enumerate(axes):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else ""))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0, 1.02)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if k % cols == 0:
            ax.set_ylabel("miss ratio", fontsize=8)
        if k >= n - cols:
            ax.set_xlabel("cache rows", fontsize=8)
    fig.suptitle(f"cache sizing, policy {plan.policy}: budget {human_bytes(plan.budget_bytes)} -> predicted hit "
                 f"rate {plan.hit_rate:.3f}, {human_bytes(plan.pcie_bytes_per_step)} host->device per step",
                 fontsize=10)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=min(len(handles), 4),
               fontsize=8, frameon=False)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["MAX_PANELS", "SMALL_SHARE", "budget_flag", "format_range", "format_table", "human_bytes", "plot",
           "split_words"]
