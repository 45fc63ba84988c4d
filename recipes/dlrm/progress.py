"""Progress on stderr while the recipe works: tqdm bars with totals and ETA when stderr is a terminal, one plain
line per stage (and every --log-every steps) when it is not (a log file, CI), nothing with --quiet. Only rank 0
of a torchrun job reports."""
from __future__ import annotations

import sys
import time


def _reporting(args) -> bool:
    return not args.quiet and getattr(args, "rank", 0) == 0


def bars_on(args) -> bool:
    """tqdm bars: not --quiet, rank 0, stderr a terminal."""
    return _reporting(args) and sys.stderr.isatty()


def lines_on(args) -> bool:
    """Plain progress lines instead of bars: not --quiet, rank 0, stderr not a terminal."""
    return _reporting(args) and not sys.stderr.isatty()


def say(args, text: str) -> None:
    """One line of progress on stderr (not with --quiet, rank 0 only)."""
    if _reporting(args):
        print(text, file=sys.stderr, flush=True)


def clock(seconds: float) -> str:
    """0.0612 s, 4.21 s, 1 min 05 s, 2 h 03 min."""
    if seconds != seconds:  # NaN
        return "n/a"
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def bar(args, iterable=None, **kwargs):
    """A tqdm bar on stderr, disabled unless bars_on(args)."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, disable=not bars_on(args), dynamic_ncols=True, **kwargs)


class StageProgress:
    """The `progress(stage, done, total, unit)` callback of the data generator and preprocessing: a bar per stage
    on a terminal, else one line when a stage ends (`data: parsing 400,000 samples in 2.1 s`)."""

    def __init__(self, args, prefix: str = "data: "):
        self.args, self.prefix = args, prefix
        self.stage = self.bar = None
        self.total, self.unit, self.started = 0, "", 0.0

    def __call__(self, stage: str, done: int, total: int, unit: str) -> None:
        if stage != self.stage:
            self.close()
            self.stage, self.total, self.unit, self.started = stage, total, unit, time.perf_counter()
            word = unit if unit == "B" else " " + unit  # 12.3MB/s, 150k samples/s
            self.bar = bar(self.args, total=total, desc=self.prefix + stage, unit=word,
                           unit_scale=total >= 10_000)  # 400k/400k, but 26/26 tables
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is None:
            return
        self.bar.close()
        if lines_on(self.args):
            amount = f"{self.total / 2**20:,.0f} MiB" if self.unit == "B" else f"{self.total:,} {self.unit}"
            print(f"{self.prefix}{self.stage} {amount} in {clock(time.perf_counter() - self.started)}",
                  file=sys.stderr, flush=True)
        self.stage = self.bar = None


def step_line(epoch: int, epochs: int, done: int, total: int, elapsed: float, loss: float, hit_rate: float,
              samples_per_s: float) -> str:
    """The progress line printed every --log-every steps when there is no bar: totals and an ETA."""
    eta = elapsed / done * (total - done) if done else float("nan")
    return (f"epoch {epoch + 1}/{epochs}  step {done}/{total} ({100 * done / max(total, 1):.0f}%)  loss {loss:.4f}  "
            f"hit rate {hit_rate:.3f}  {samples_per_s:,.0f} samples/s  eta {clock(eta)}")
