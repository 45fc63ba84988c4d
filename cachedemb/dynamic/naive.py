"""Reference for cachedemb.dynamic: the same admission, eviction and ttl rules over a Python dict, with rows
numbered freshly per admission (never reused), so "an evicted id that returns is a never-seen id" holds by
construction. Tests and benchmarks pair it with a dense table (row 0: the unadmitted row, row 1: padding,
admissions from 2 on). `initial_rows_reference` is the initial-row generator written out op by op, as
cachedemb.dynamic.initial_rows was first written (that one computes the same bits in place); `probe_reference`
is IdIndex's lookup and insert rounds one key at a time."""
from __future__ import annotations

import math
from collections import Counter

import torch

from cachedemb.dynamic.embedding_bag import DynamicIds
from cachedemb.dynamic.index import _GOLDEN, _i64, _lsr, mix64

UNADMITTED_ROW, PAD_ROW = 0, 1


def probe_reference(table: list[int], state: list[int], home: list[int], keys: list[int], mask: int,
                    max_probe: int) -> tuple[list[int], list[int]]:
    """IdIndex.lookup then IdIndex._try_insert of the absent keys, scalar, on plain lists (state 0 empty, 1 live,
    2 tombstone; changed in place). Lookup: probe from the home slot until the key or an empty slot. Insert:
    round d places every key still probing at home + d if that slot was not live when the round began; keys
    reaching one slot in the same round: the earliest in `keys` wins, the others go on. Returns (slot of each key
    before the insert or -1, slot after; -1 where max_probe rounds did not place it)."""
    found = []
    for key, h in zip(keys, home):
        slot, d = -1, 0
        while state[(h + d) & mask] != 0:
            if state[(h + d) & mask] == 1 and table[(h + d) & mask] == key:
                slot = (h + d) & mask
                break
            d += 1
        found.append(slot)
    placed = list(found)
    pending = [i for i, slot in enumerate(found) if slot < 0]
    for d in range(max_probe):
        claimed: dict[int, int] = {}
        for i in pending:
            pos = (home[i] + d) & mask
            if state[pos] != 1 and pos not in claimed:
                claimed[pos] = i
        for pos, i in claimed.items():
            table[pos], state[pos], placed[i] = keys[i], 1, pos
        pending = [i for i in pending if placed[i] < 0]
    return found, placed


def initial_rows_reference(seed: int, ids: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n, dim]: row j of id i is pairs of 53-bit uniforms u = mix64(mix64(id + mix64(seed + G)) + k * G) >>> 11
    (k = 1, 2, ...) through Box-Muller, z = sqrt(-2 log(1 - u_odd)) * (cos, sin)(2 pi u_even), in float64."""
    ids = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
    seed_key = mix64(torch.tensor([_i64(seed)], dtype=torch.int64) + _GOLDEN)
    key = mix64(ids + seed_key)  # [n]
    pairs = (dim + 1) // 2
    counter = torch.arange(1, 2 * pairs + 1, dtype=torch.int64) * _GOLDEN  # [2P]
    bits = mix64(key[:, None] + counter[None, :])  # [n, 2P]
    unit = _lsr(bits, 11).to(torch.float64) * 2.0 ** -53  # [0, 1)
    u1, u2 = 1.0 - unit[:, 0::2], unit[:, 1::2]  # u1 in (0, 1]
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2.0 * math.pi) * u2
    z = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=2).reshape(ids.numel(), 2 * pairs)
    return z[:, :dim].to(dtype)


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
