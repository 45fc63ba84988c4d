"""id -> cache slot index: an open-addressing hash table on the device, O(distinct ids) per lookup batch and
O(misses) per insert / delete batch (the sorted index it replaces was re-sorted whole after every admission).

Layout: one int64 table `keys [H]`, H a power of two >= 2 x cache rows (16 bytes per cache row when the row count
is a power of two). An entry is EMPTY (-1), TOMB (-2, a deleted id: probes go past it, inserts reuse it) or a
resident id and its slot packed as `id << 30 | slot` (ids < 2^33, slots < 2^30), so one load per probe compares
the id and yields the slot. An id's home is the low bits of murmur3's 64-bit finalizer, so ids
equal in their low bits (multiples of 2^32, strided ids) spread over the table. Linear probing: a lookup walks
from the id's home to the id or to an EMPTY (no resident id sits past an EMPTY of its chain: inserts take the
first free position, deletes leave TOMB, and EMPTY comes back only with a rebuild of the whole table).

Inserts are bounded: an id is placed within MAX_PROBE positions of its home or reported not inserted (the cache
then serves that id from the host). The Triton insert is one launch: every key walks its chain and claims the
first free position (EMPTY or TOMB) with an atomic compare-and-swap, so the layout depends on the order the GPU
runs the keys in, while every lookup answer stays exact. The torch reference inserts in deterministic rounds
(a scan, then a claim per position won by the largest id, an atomic max that commutes), bounded by
INSERT_ROUNDS as well. A rebuild lays out every resident id afresh (tombstones cleared): `index_build` (sort by
home, cummax) on the host-count path; under the CUDA rules two launches gated by a device flag
(`index_rebuild`: clear, re-insert), so a step with fixed shapes launches the same kernels whether or not it
rebuilds. A rebuild
places every id (at load <= 1/2 nothing is far from home), which is why lookups are not bounded by MAX_PROBE.

`early_exit=True` lets a loop stop once no key is pending, which reads a count on the host: free on CPU, a sync
on CUDA, so the cache passes it only where counts are free; the results are the same either way.
"""

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device
from .gather import take

EMPTY = -1
TOMB = -2
MAX_PROBE = 128
PROBE_WINDOW = 16
INSERT_ROUNDS = 24
_M1 = 0xFF51AFD7ED558CCD - (1 << 64)  # murmur3 fmix64 multipliers as signed int64
_M2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_LOW31 = (1 << 31) - 1
SLOT_BITS = 30
SLOT_MASK = (1 << SLOT_BITS) - 1
MAX_ID = 1 << 33  # ids below this pack with a slot into one int64
_NO_CHANGE_MAX = torch.iinfo(torch.int64).min  # scatter_reduce("amax") value that changes nothing
_NO_CHANGE_MIN = torch.iinfo(torch.int64).max


def index_size(capacity: int) -> int:
    """Positions of the table for `capacity` cache rows: a power of two >= 2 x capacity (load <= 1/2)."""
    return max(16, triton.next_power_of_2(2 * int(capacity)))


def new_index(capacity: int, device) -> torch.Tensor:
    """An empty index: keys [H] int64."""
    return torch.full((index_size(capacity),), EMPTY, dtype=torch.int64, device=device)


def pack(ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return (ids << SLOT_BITS) | slots.to(torch.int64)


def mix_torch(ids: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix64 over int64 (wrapping multiplies; `& _LOW31` makes the arithmetic shifts logical)."""
    x = ids ^ ((ids >> 33) & _LOW31)
    x = x * _M1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M2
    return x ^ ((x >> 33) & _LOW31)


def _home(ids: torch.Tensor, size: int) -> torch.Tensor:
    return mix_torch(ids) & (size - 1)


def _live_mask(n_items: int, n, device) -> torch.Tensor:
    return torch.arange(n_items, device=device) < n


# ---------------------------------------------------------------- reference


def index_find_torch(keys: torch.Tensor, query: torch.Tensor, n_query, early_exit: bool = False):
    """(position, slot) of each of the first n_query ids of `query` [B]; -1 for an absent or negative id."""
    if early_exit:
        return _find_compacting(keys, query, n_query)
    size = keys.numel()
    mask = size - 1
    pos = torch.full_like(query, -1)
    slot = torch.full_like(query, -1)
    active = _live_mask(query.numel(), n_query, query.device) & (query >= 0)
    home = _home(query, size)
    idx = torch.arange(query.numel(), device=query.device)
    # A short first window: at load <= 1/2 most probes end within a couple of positions. Chains longer than
    # MAX_PROBE (only after a rebuild, rare) are walked on while any id is still probing.
    start, windows = 0, [2, PROBE_WINDOW - 2] + [PROBE_WINDOW] * (MAX_PROBE // PROBE_WINDOW - 1)
    while start < size:
        if start >= MAX_PROBE and not bool(active.any()):
            break
        width = windows.pop(0) if windows else PROBE_WINDOW
        offs = torch.arange(width, device=query.device)
        p = (home[idx, None] + start + offs) & mask  # [n, W]
        k = keys[p]
        a = active[idx]
        hit = (k >= 0) & ((k >> SLOT_BITS) == query[idx, None]) & a[:, None]
        found = hit.any(1)
        first = hit.to(torch.int8).argmax(1, keepdim=True)
        pos[idx] = torch.where(found, p.gather(1, first).squeeze(1), pos[idx])
        slot[idx] = torch.where(found, k.gather(1, first).squeeze(1) & SLOT_MASK, slot[idx])
        active[idx] = a & (hit | (k == EMPTY)).any(1).logical_not()
        start += width
    return pos, slot


# Positions probed one at a time (then windows) by `_find_compacting`: at load <= 5/8 most chains end here.
_SINGLE_PROBES = 4


def _find_compacting(keys: torch.Tensor, query: torch.Tensor, n_query):
    """index_find_torch where counts are free on the host (CPU): the still-probing ids are compacted after
    every probe (nonzero), so each probe touches only them, one position each for the first _SINGLE_PROBES
    positions (no [n, W] windows, no argmax), then PROBE_WINDOW positions at a time. Same answer: the first
    position of the chain holding the id, the chain ending at an EMPTY (a resident id never sits past an EMPTY
    of its chain: inserts take the first free position, deletes leave TOMB)."""
    size = keys.numel()
    mask = size - 1
    pos = torch.full_like(query, -1)
    slot = torch.full_like(query, -1)
    idx = (_live_mask(query.numel(), n_query, query.device) & (query >= 0)).nonzero().squeeze(1)
    q = take(query, idx)
    home = _home(q, size)
    start = 0
    while idx.numel() and start < size:
        width = 1 if start < _SINGLE_PROBES else PROBE_WINDOW
        if width == 1:
            p = (home + start) & mask
            k = take(keys, p)
            hit = (k >= 0) & ((k >> SLOT_BITS) == q)
            at = hit.nonzero().squeeze(1)
            found_at = take(idx, at)
            pos.index_copy_(0, found_at, take(p, at))
            slot.index_copy_(0, found_at, take(k, at) & SLOT_MASK)
            go_on = (hit | (k == EMPTY)).logical_not()
        else:
            p = (home[:, None] + start + torch.arange(width, device=query.device)) & mask  # [n, W]
            k = take(keys, p)
            hit = (k >= 0) & ((k >> SLOT_BITS) == q[:, None])
            found = hit.any(1)
            at = found.nonzero().squeeze(1)
            first = take(hit, at).to(torch.int8).argmax(1, keepdim=True)
            found_at = take(idx, at)
            pos.index_copy_(0, found_at, take(p, at).gather(1, first).squeeze(1))
            slot.index_copy_(0, found_at, take(k, at).gather(1, first).squeeze(1) & SLOT_MASK)
            go_on = (found | (k == EMPTY).any(1)).logical_not()
        keep = go_on.nonzero().squeeze(1)
        idx, q, home = take(idx, keep), take(q, keep), take(home, keep)
        start += width
    return pos, slot


def index_lookup_torch(keys, query, n_query, early_exit: bool = False) -> torch.Tensor:
    """Slot of each of the first n_query ids of `query` [B] (int64); -1 for a miss, a negative id, or past n."""
    return index_find_torch(keys, query, n_query, early_exit)[1]


def _tombstone(keys, pos) -> None:
    """keys[pos] = TOMB where pos >= 0 (a min: TOMB is below every entry; other lanes change nothing)."""
    found = pos >= 0
    keys.scatter_reduce_(0, pos.clamp(min=0), torch.where(found, torch.full_like(pos, TOMB),
                                                          torch.full_like(pos, _NO_CHANGE_MIN)), "amin")


def index_delete_torch(keys, ids, n, early_exit: bool = False) -> None:
    """Tombstone the first n `ids` (negative or absent ids are skipped)."""
    _tombstone(keys, index_find_torch(keys, ids, n, early_exit)[0])


def _first_free(keys, home, dist, pending, lo: int, width: int):
    """First free position (EMPTY or TOMB) in [dist + lo, dist + lo + width) of each pending key: (has [n],
    position [n], its distance [n]); position and distance are meaningless where `has` is False."""
    size = keys.numel()
    if width == 1:
        d = dist + lo
        p = (home + d) & (size - 1)
        return (take(keys, p) < 0) & (d < MAX_PROBE) & pending, p, d
    d = dist[:, None] + torch.arange(lo, lo + width, device=dist.device)
    p = (home[:, None] + d) & (size - 1)
    free = (take(keys, p) < 0) & (d < MAX_PROBE) & pending[:, None]
    first = free.to(torch.int8).argmax(1, keepdim=True)
    return free.any(1), p.gather(1, first).squeeze(1), d.gather(1, first).squeeze(1)


def _scan_torch(keys, home, dist, pending, narrow: bool = False):
    """One scan: first free position in the window [dist, dist + W) of each pending key (-1: none).
    Returns (target, target distance, dist for keys that found none). `narrow` (counts free on the host):
    the first position alone, then the rest of the window only for the keys whose first position is taken
    (the same answer, mostly without the [n, W] window)."""
    if narrow:
        has, target, tdist = _first_free(keys, home, dist, pending, 0, 1)
        rest = (pending & has.logical_not()).nonzero().squeeze(1)
        if rest.numel():
            r_has, r_target, r_tdist = _first_free(keys, take(home, rest), take(dist, rest), take(pending, rest),
                                                   1, PROBE_WINDOW - 1)
            has = has.index_copy(0, rest, r_has)
            target = target.index_copy(0, rest, r_target)
            tdist = tdist.index_copy(0, rest, r_tdist)
    else:
        has, target, tdist = _first_free(keys, home, dist, pending, 0, PROBE_WINDOW)
    target = torch.where(has, target, torch.full_like(dist, -1))
    dist = torch.where(pending & has.logical_not(), dist + PROBE_WINDOW, dist)
    return target, tdist, dist


def index_insert_torch(keys, ids, slots, n, early_exit: bool = False, used: torch.Tensor | None = None):
    """Insert the first n (id, slot) pairs (ids distinct and absent; negative ids skipped). Returns ok [B] bool:
    False for a skipped id and for one not placed within MAX_PROBE positions / INSERT_ROUNDS rounds. `used`
    ([1] int64, optional) counts the EMPTY positions claimed (positions no longer EMPTY)."""
    size = keys.numel()
    dev = ids.device
    pending = _live_mask(ids.numel(), n, dev) & (ids >= 0)
    ok = torch.zeros_like(pending)
    home = _home(ids, size)
    entry = pack(ids.clamp(min=0), slots.clamp(min=0))
    dist = torch.zeros_like(ids)
    idx = torch.arange(ids.numel(), device=dev)
    for _ in range(INSERT_ROUNDS):
        if early_exit:
            idx = pending.nonzero().squeeze(1)
            if idx.numel() == 0:
                break
        i_entry, i_pend = take(entry, idx), take(pending, idx)
        target, tdist, i_dist = _scan_torch(keys, take(home, idx), take(dist, idx), i_pend, narrow=early_exit)
        proposer = target >= 0
        at = target.clamp(min=0)
        was_empty = take(keys, at) == EMPTY
        keys.scatter_reduce_(0, at, torch.where(proposer, i_entry, torch.full_like(i_entry, _NO_CHANGE_MAX)), "amax")
        won = proposer & (take(keys, at) == i_entry)
        if used is not None:
            used += (won & was_empty).sum()
        i_dist = torch.where(proposer & won.logical_not(), tdist + 1, i_dist)
        ok.index_copy_(0, idx, take(ok, idx) | won)
        dist.index_copy_(0, idx, i_dist)
        pending.index_copy_(0, idx, i_pend & won.logical_not() & (i_dist < MAX_PROBE))
    return ok


def index_build(keys, ids, slots) -> torch.Tensor:
    """Lay out every (id >= 0, slot) pair from scratch (tombstones cleared) in O(n log n) with no rounds: keys
    sorted by (home, id) take position i + cummax(home - i) (linear probing in that order); the run that wraps
    past the end is placed at the front (a run that wraps again, which needs a table nearly full, is probed for
    one key at a time). Every key is placed: lookups walk a chain to its end. Returns ok [n] bool (the ids >= 0).
    Backend-independent (sort + cummax)."""
    size = keys.numel()
    dev = ids.device
    n = ids.numel()
    live = ids >= 0
    if n > size and int(live.sum()) > size:
        raise ValueError(f"index_build: {int(live.sum())} ids do not fit an index of {size} positions")
    home = torch.where(live, _home(ids, size), torch.full_like(ids, 2 * size))
    # One sort by (home, id): home < 2^30 and id < 2^33 pack into one int64 (dead ids last).
    order = torch.argsort((home << 33) | ids.clamp(min=0))
    h = home[order]
    i = torch.arange(n, device=dev)
    pos = i + torch.cummax(h - i, 0).values
    wrapped = (pos >= size) & live[order]
    # The run that wrapped (a suffix of the live ids) goes first, from position 0, in the same order: a rotation
    # by device-side counts, no second sort.
    n_wrap = wrapped.sum()
    n_rest = live.sum() - n_wrap
    src = torch.where(i < n_wrap, i + n_rest, torch.where(i < n_wrap + n_rest, i - n_wrap, i))
    order = order[src]
    h = home[order]
    h2 = torch.where(i < n_wrap, torch.zeros_like(h), h)
    pos = i + torch.cummax(h2 - i, 0).values
    placed = live[order] & (pos < size)
    entry = pack(ids[order].clamp(min=0), slots[order].clamp(min=0))
    table = torch.full((size + 1,), EMPTY, dtype=torch.int64, device=dev)  # + a dump position for the rest
    table.index_put_((torch.where(placed, pos, torch.full_like(pos, size)),), entry)
    left = live[order] & placed.logical_not()
    if bool(left.any()):  # the rotated run wrapped again (a table nearly full): probe for the few left, one by one
        host = table[:size].cpu()
        for e in entry[left].tolist():
            p = int(mix_torch(torch.tensor([e >> SLOT_BITS])) & (size - 1))
            while int(host[p]) != EMPTY:
                p = (p + 1) & (size - 1)
            host[p] = e
        table[:size].copy_(host)
    keys.copy_(table[:size])
    return live


# ---------------------------------------------------------------- device-gated rebuild (reference)


def index_rebuild_torch(keys, slot_ids, flag, used) -> None:
    """Under the CUDA rules, where the [1] device `flag` is set (kernels/place.py sets it, and zeroes `used`, when
    the index could pass its load limit): lay out every resident id (slot_ids[s] >= 0 sits in slot s) afresh and
    add their count to `used` (positions not EMPTY). Reference: reads the flag on the host."""
    if not int(flag):
        return
    ids = slot_ids.reshape(-1)
    index_build(keys, ids, torch.arange(ids.numel(), device=ids.device))
    used += (keys != EMPTY).sum()


# ---------------------------------------------------------------- Triton


@triton.jit
def _mix(x):
    x = x ^ ((x >> 33) & 0x7FFFFFFF)
    x = x * -49064778989728563  # 0xFF51AFD7ED558CCD
    x = x ^ ((x >> 33) & 0x7FFFFFFF)
    x = x * -4265267296055464877  # 0xC4CEB9FE1A85EC53
    return x ^ ((x >> 33) & 0x7FFFFFFF)


@triton.jit
def probe_find(p_keys, b_q, m_act, MASK):
    """(position, slot) of each active lane's id, -1 where absent: each lane walks from its id's home to the id
    or to an EMPTY; the block stops when all its lanes did."""
    b_home = _mix(b_q) & MASK
    b_pos = tl.zeros_like(b_q) - 1
    b_slot = tl.zeros_like(b_q) - 1
    # The probe distance as a tensor (equal in every lane): the loop-carried mask then only ever meets tensor
    # compares (a Python-int distance makes `m_act & (d < H)` an int tensor under Triton 3.9's interpreter).
    b_d = tl.zeros_like(b_q)
    n_act = tl.sum(m_act.to(tl.int32), 0)
    while n_act > 0:
        b_p = (b_home + b_d) & MASK
        b_k = tl.load(p_keys + b_p, mask=m_act, other=-1)
        m_hit = m_act & (b_k >= 0) & ((b_k >> 30) == b_q)
        b_pos = tl.where(m_hit, b_p, b_pos)
        b_slot = tl.where(m_hit, b_k & 0x3FFFFFFF, b_slot)
        m_act = m_act & (m_hit == 0) & (b_k != -1) & (b_d < MASK)
        b_d += 1
        n_act = tl.sum(m_act.to(tl.int32), 0)
    return b_pos, b_slot


@triton.jit
def probe_insert(p_keys, b_entry, b_home, m_ins, MASK, max_p):
    """Each active lane claims the first free position (EMPTY or TOMB) within max_p of its home with a
    compare-and-swap; a lane that loses a position to another looks at it again (now taken) and goes on.
    Returns (placed, claimed an EMPTY), bool per lane."""
    b_d = tl.zeros_like(b_entry)
    m_act = m_ins
    m_ok = m_ins & (b_d != 0)
    m_new = m_ok
    n_act = tl.sum(m_act.to(tl.int32), 0)
    while n_act > 0:
        b_p = (b_home + b_d) & MASK
        b_k = tl.load(p_keys + b_p, mask=m_act, other=0)
        m_try = m_act & (b_k < 0)
        # lanes not trying compare with -3, which no entry holds: the swap writes nothing for them
        b_old = tl.atomic_cas(p_keys + b_p, tl.where(m_try, b_k, -3), b_entry, sem="relaxed")
        m_won = m_try & (b_old == b_k)
        m_ok = m_ok | m_won
        m_new = m_new | (m_won & (b_k == -1))
        b_d = tl.where(m_act & (b_k >= 0), b_d + 1, b_d)
        m_act = m_act & (m_won == 0) & (b_d < max_p)
        n_act = tl.sum(m_act.to(tl.int32), 0)
    return m_ok, m_new


@triton.jit(do_not_specialize=["B"])
def index_find_kernel(p_keys, p_query, n_ptr, o_pos, o_slot, B, MASK, BLOCK: tl.constexpr):
    o_i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    b_q = tl.load(p_query + o_i, mask=m_i, other=-1)
    b_pos, b_slot = probe_find(p_keys, b_q, m_i & (o_i < tl.load(n_ptr)) & (b_q >= 0), MASK)
    tl.store(o_pos + o_i, b_pos, mask=m_i)
    tl.store(o_slot + o_i, b_slot, mask=m_i)


@triton.jit(do_not_specialize=["B"])
def index_delete_kernel(p_keys, p_ids, n_ptr, B, MASK, BLOCK: tl.constexpr):
    """Tombstone each of the first n ids found."""
    o_i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    b_q = tl.load(p_ids + o_i, mask=m_i, other=-1)
    b_pos, _ = probe_find(p_keys, b_q, m_i & (o_i < tl.load(n_ptr)) & (b_q >= 0), MASK)
    tl.store(p_keys + b_pos, tl.zeros_like(b_pos) - 2, mask=b_pos >= 0)


@triton.jit(do_not_specialize=["B", "max_p"])
def index_insert_kernel(p_keys, p_ids, p_slots, n_ptr, o_ok, p_used, B, MASK, max_p, BLOCK: tl.constexpr,
                        HAS_USED: tl.constexpr):
    """Insert the first n (id >= 0, slot) pairs in one pass (atomic compare-and-swap claims)."""
    o_i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    b_id = tl.load(p_ids + o_i, mask=m_i, other=-1)
    m_ins = m_i & (o_i < tl.load(n_ptr)) & (b_id >= 0)
    b_slot = tl.load(p_slots + o_i, mask=m_ins, other=0)
    b_entry = (tl.maximum(b_id, 0) << 30) | b_slot
    m_ok, m_new = probe_insert(p_keys, b_entry, _mix(b_id) & MASK, m_ins, MASK, max_p)
    tl.store(o_ok + o_i, m_ok.to(tl.int8), mask=m_i)
    if HAS_USED:
        tl.atomic_add(p_used, tl.sum(m_new.to(tl.int64), 0), sem="relaxed")


@triton.jit
def index_clear_kernel(p_keys, p_flag, H, BLOCK: tl.constexpr):
    """Gated on the flag: every position EMPTY (the rebuild's first launch)."""
    if tl.load(p_flag) != 0:
        o_i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(p_keys + o_i, tl.zeros_like(o_i) - 1, mask=o_i < H)


@triton.jit(do_not_specialize=["C"])
def index_fill_kernel(p_keys, p_slot_ids, p_flag, p_used, C, MASK, BLOCK: tl.constexpr):
    """Gated on the flag: every resident id (slot_ids[s] >= 0) into the cleared table at slot s; every one is
    placed (the table is at most half full); `used` counts them."""
    if tl.load(p_flag) != 0:
        o_s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m_s = o_s < C
        b_id = tl.load(p_slot_ids + o_s, mask=m_s, other=-1)
        m_ins = m_s & (b_id >= 0)
        _, m_new = probe_insert(p_keys, (tl.maximum(b_id, 0) << 30) | o_s, _mix(b_id) & MASK, m_ins, MASK, MASK + 1)
        tl.atomic_add(p_used, tl.sum(m_new.to(tl.int64), 0), sem="relaxed")


def _block(n: int, device) -> int:
    # >= 16 lanes: Triton's interpreter before 3.3 ignores the mask of a one-element store
    return min(256 if gpu_shapes(device) else 4096, max(16, triton.next_power_of_2(n)))


def _n_tensor(n, device) -> torch.Tensor:
    if torch.is_tensor(n):
        return n.reshape(1).to(device=device, dtype=torch.int64)
    return torch.full((1,), int(n), dtype=torch.int64, device=device)


def index_find_triton(keys, query, n_query):
    """(position, slot) of each of the first n_query ids of `query`; -1 for a miss."""
    B = query.numel()
    pos = torch.empty(B, dtype=torch.int64, device=query.device)
    slot = torch.empty(B, dtype=torch.int64, device=query.device)
    if B == 0:
        return pos, slot
    BLOCK = _block(B, query.device)
    index_find_kernel[(triton.cdiv(B, BLOCK),)](keys, query.contiguous(), _n_tensor(n_query, query.device), pos,
                                                slot, B, keys.numel() - 1, BLOCK=BLOCK)
    return pos, slot


def index_lookup_triton(keys, query, n_query, early_exit: bool = False):
    return index_find_triton(keys, query, n_query)[1]


def index_delete_triton(keys, ids, n, early_exit: bool = False) -> None:
    B = ids.numel()
    if B == 0:
        return
    BLOCK = _block(B, ids.device)
    index_delete_kernel[(triton.cdiv(B, BLOCK),)](keys, ids.contiguous(), _n_tensor(n, ids.device), B,
                                                  keys.numel() - 1, BLOCK=BLOCK)


def index_insert_triton(keys, ids, slots, n, early_exit: bool = False, used: torch.Tensor | None = None):
    """Insert in one launch (compare-and-swap claims): every lookup answers as after `index_insert_torch`, while
    the layout (and, rarely, which ids of a crowded chain find no position) may differ."""
    B = ids.numel()
    dev = ids.device
    ok = torch.empty(B, dtype=torch.int8, device=dev)
    if B == 0:
        return ok.bool()
    BLOCK = _block(B, dev)
    index_insert_kernel[(triton.cdiv(B, BLOCK),)](
        keys, ids.contiguous(), slots.contiguous(), _n_tensor(n, dev), ok, used if used is not None else ok, B,
        keys.numel() - 1, MAX_PROBE, BLOCK=BLOCK, HAS_USED=used is not None)
    return ok.view(torch.bool)


def index_rebuild_triton(keys, slot_ids, flag, used) -> None:
    """index_rebuild_torch in two launches gated on the device flag (no host read): clear, then re-insert."""
    C, H = slot_ids.numel(), keys.numel()
    dev = keys.device
    block = min(1024 if gpu_shapes(dev) else 16384, max(16, triton.next_power_of_2(H)))
    index_clear_kernel[(triton.cdiv(H, block),)](keys, flag, H, BLOCK=block)
    block = _block(C, dev)
    index_fill_kernel[(triton.cdiv(C, block),)](keys, slot_ids, flag, used, C, H - 1, BLOCK=block)


# ---------------------------------------------------------------- dispatch


def index_lookup(keys, query, n_query, early_exit: bool = False):
    if backend_for(query.device) == "triton":
        with on_device(query):
            return index_lookup_triton(keys, query, n_query, early_exit)
    return index_lookup_torch(keys, query, n_query, early_exit)


def index_delete(keys, ids, n, early_exit: bool = False) -> None:
    if backend_for(ids.device) == "triton":
        with on_device(ids):
            return index_delete_triton(keys, ids, n, early_exit)
    return index_delete_torch(keys, ids, n, early_exit)


def index_insert(keys, ids, slots, n, early_exit: bool = False, used: torch.Tensor | None = None) -> torch.Tensor:
    if backend_for(ids.device) == "triton":
        with on_device(ids):
            return index_insert_triton(keys, ids, slots, n, early_exit, used)
    return index_insert_torch(keys, ids, slots, n, early_exit, used)


def index_rebuild(keys, slot_ids, flag, used) -> None:
    if backend_for(keys.device) == "triton":
        with on_device(keys):
            return index_rebuild_triton(keys, slot_ids, flag, used)
    return index_rebuild_torch(keys, slot_ids, flag, used)
