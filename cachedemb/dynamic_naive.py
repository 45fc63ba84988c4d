"""Reference for cachedemb.dynamic: the same admission, eviction and ttl rules over a Python dict, with rows
numbered freshly per admission (never reused), so "an evicted id that returns is a never-seen id" holds by
construction. Tests and benchmarks pair it with a dense table (row 0: the unadmitted row, row 1: padding,
admissions from 2 on)."""
from __future__ import annotations

from collections import Counter

from cachedemb.dynamic import DynamicIds

UNADMITTED_ROW, PAD_ROW = 0, 1


class NaiveDynamicIds:
    """id -> [count, last seen step, row or None]; `new_rows` lists the (row, id) admitted by the last remap."""

    def __init__(self, config: DynamicIds, padding_idx: int | None = None):
        self.config, self.padding_idx = config, padding_idx
        self.entries: dict[int, list] = {}
        self.step = 0
        self.next_row = 2
        self.new_rows: list[tuple[int, int]] = []

    def admitted(self) -> dict[int, int]:
        return {i: e[2] for i, e in self.entries.items() if e[2] is not None}

    def remap(self, ids: list[int], train: bool) -> list[int]:
        cfg = self.config
        self.new_rows = []
        if train:
            if cfg.ttl_steps is not None and self.step > 0 and self.step % cfg.ttl_steps == 0:
                self.evict_stale()
            self.step += 1
            counts = Counter(i for i in ids if i != self.padding_idx)
            for i in sorted(counts):
                entry = self.entries.setdefault(i, [0, 0, None])
                entry[0] += counts[i]
                entry[1] = self.step
            want = [i for i in sorted(counts) if self.entries[i][2] is None and self.entries[i][0] >= cfg.min_count]
            free = cfg.capacity - len(self.admitted())
            if len(want) > free and cfg.on_full != "reject":
                def key(i):
                    count, last, _ = self.entries[i]
                    return (count, last, i) if cfg.on_full == "evict_lfu" else (last, count, i)
                victims = sorted((i for i, e in self.entries.items() if e[2] is not None and i not in counts), key=key)
                for i in victims[:len(want) - free]:
                    del self.entries[i]
                free = cfg.capacity - len(self.admitted())
            for i in want[:free]:
                self.entries[i][2] = self.next_row
                self.new_rows.append((self.next_row, i))
                self.next_row += 1
        out = []
        for i in ids:
            if i == self.padding_idx:
                out.append(PAD_ROW)
            else:
                entry = self.entries.get(i)
                out.append(entry[2] if entry is not None and entry[2] is not None else UNADMITTED_ROW)
        return out

    def evict_stale(self, ttl_steps: int | None = None) -> None:
        ttl = ttl_steps if ttl_steps is not None else self.config.ttl_steps
        for i in [i for i, e in self.entries.items() if self.step - e[1] >= ttl]:
            del self.entries[i]
