"""id -> cache slot index: an open-addressing hash table on the device, O(distinct ids) per lookup batch and
O(misses) per insert / delete batch (the sorted index it replaces was re-sorted whole after every admission).

Layout: one int64 table `keys [H]`, H a power of two >= 2 x cache rows (16 bytes per cache row when the row count
is a power of two). An entry is EMPTY (-1), TOMB (-2, a deleted id: probes go past it, inserts reuse it) or a
resident id and its slot packed as `id << 30 | slot` (ids < 2^33, slots < 2^30), so one load per probe compares
the id and yields the slot. An id's home is the low bits of murmur3's 64-bit finalizer, so ids
equal in their low bits (multiples of 2^32, strided ids) spread over the table. Linear probing, bounded: no key
sits more than MAX_PROBE positions past its home, so a lookup stops at the id, at an EMPTY, or after MAX_PROBE.

Inserts run in rounds, each a scan then a claim, so the layout does not depend on thread order: every pending
key looks at the next PROBE_WINDOW positions for the first free one (EMPTY or TOMB) and proposes there; per
position the largest proposing entry (= the largest id) wins (an atomic max, commutative); losers go on past that position. A key not
placed within MAX_PROBE positions or INSERT_ROUNDS rounds is reported not inserted (the cache then serves that id
from the host). `index_build` lays out a whole set of keys at once (sort by home, cummax), for the rare rebuild
that clears the tombstones.

`early_exit=True` lets a loop stop once no key is pending, which reads a count on the host: free on CPU, a sync
on CUDA, so the cache passes it only where counts are free; the results are the same either way.
"""

import torch
import triton
import triton.language as tl

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
    # A short first window: at load <= 1/2 most probes end within a couple of positions.
    for start, width in [(0, 2), (2, PROBE_WINDOW - 2)] + [(s, PROBE_WINDOW) for s in range(PROBE_WINDOW, MAX_PROBE,
                                                                                                PROBE_WINDOW)]:
        offs = torch.arange(width, device=query.device)
        if early_exit:
            idx = active.nonzero().squeeze(1)
            if idx.numel() == 0:
                break
        p = (home[idx, None] + start + offs) & mask  # [n, W]
        k = keys[p]
        a = active[idx]
        hit = (k >= 0) & ((k >> SLOT_BITS) == query[idx, None]) & a[:, None]
        found = hit.any(1)
        first = hit.to(torch.int8).argmax(1, keepdim=True)
        pos[idx] = torch.where(found, p.gather(1, first).squeeze(1), pos[idx])
        slot[idx] = torch.where(found, k.gather(1, first).squeeze(1) & SLOT_MASK, slot[idx])
        active[idx] = a & (hit | (k == EMPTY)).any(1).logical_not()
    return pos, slot


# Positions probed one at a time (then windows) by `_find_compacting`: at load <= 5/8 most chains end here.
_SINGLE_PROBES = 4


def _find_compacting(keys: torch.Tensor, query: torch.Tensor, n_query):
    """index_find_torch where counts are free on the host (CPU): the still-probing ids are compacted after
    every probe (nonzero), so each probe touches only them, one position each for the first _SINGLE_PROBES
    positions (no [n, W] windows, no argmax), then PROBE_WINDOW positions at a time. Same answer: the first
    position of the chain holding the id, the chain ending at an EMPTY or after MAX_PROBE positions (a
    resident id never sits past an EMPTY of its chain: inserts take the first free position, deletes leave
    TOMB)."""
    size = keys.numel()
    mask = size - 1
    pos = torch.full_like(query, -1)
    slot = torch.full_like(query, -1)
    idx = (_live_mask(query.numel(), n_query, query.device) & (query >= 0)).nonzero().squeeze(1)
    q = take(query, idx)
    home = _home(q, size)
    start = 0
    while idx.numel() and start < MAX_PROBE:
        width = 1 if start < _SINGLE_PROBES else min(PROBE_WINDOW, MAX_PROBE - start)
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


def index_insert_torch(keys, ids, slots, n, early_exit: bool = False) -> torch.Tensor:
    """Insert the first n (id, slot) pairs (ids distinct and absent; negative ids skipped). Returns ok [B] bool:
    False for a skipped id and for one not placed within MAX_PROBE positions / INSERT_ROUNDS rounds."""
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
        keys.scatter_reduce_(0, at, torch.where(proposer, i_entry, torch.full_like(i_entry, _NO_CHANGE_MAX)), "amax")
        won = proposer & (take(keys, at) == i_entry)
        i_dist = torch.where(proposer & won.logical_not(), tdist + 1, i_dist)
        ok.index_copy_(0, idx, take(ok, idx) | won)
        dist.index_copy_(0, idx, i_dist)
        pending.index_copy_(0, idx, i_pend & won.logical_not() & (i_dist < MAX_PROBE))
    return ok


def index_build(keys, ids, slots) -> torch.Tensor:
    """Lay out every (id >= 0, slot) pair from scratch (tombstones cleared) in O(n log n) with no rounds: keys
    sorted by (home, id) take position i + cummax(home - i) (linear probing in that order); the run that wraps
    past the end is placed at the front. Keys that would sit MAX_PROBE or more past their home become TOMB (the
    probe chains of later keys stay whole). Returns ok [n] bool. Backend-independent (sort + cummax)."""
    size = keys.numel()
    dev = ids.device
    n = ids.numel()
    live = ids >= 0
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
    dist = (pos - h) & (size - 1)
    placed = live[order] & (pos < size)
    ok_s = placed & (dist < MAX_PROBE)
    entry = torch.where(ok_s, pack(ids[order].clamp(min=0), slots[order].clamp(min=0)), torch.full_like(pos, TOMB))
    table = torch.full((size + 1,), EMPTY, dtype=torch.int64, device=dev)  # + a dump position for the rest
    table.index_put_((torch.where(placed, pos, torch.full_like(pos, size)),), entry)
    keys.copy_(table[:size])
    ok = torch.zeros(n, dtype=torch.bool, device=dev)
    ok[order] = ok_s
    return ok


# ---------------------------------------------------------------- Triton


@triton.jit
def _mix(x):
    x = x ^ ((x >> 33) & 0x7FFFFFFF)
    x = x * -49064778989728563  # 0xFF51AFD7ED558CCD
    x = x ^ ((x >> 33) & 0x7FFFFFFF)
    x = x * -4265267296055464877  # 0xC4CEB9FE1A85EC53
    return x ^ ((x >> 33) & 0x7FFFFFFF)


@triton.jit(do_not_specialize=["B"])
def index_find_kernel(p_keys, p_query, n_ptr, o_pos, o_slot, B, MASK, MAX_P: tl.constexpr, BLOCK: tl.constexpr):
    """Probe from each query's home until the id, an EMPTY, or MAX_P positions; the block stops when all its
    lanes did."""
    i_b = tl.program_id(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    n = tl.load(n_ptr)
    b_q = tl.load(p_query + o_i, mask=m_i, other=-1)
    b_home = _mix(b_q) & MASK
    m_act = m_i & (o_i < n) & (b_q >= 0)
    b_pos = tl.zeros([BLOCK], dtype=tl.int64) - 1
    b_slot = tl.zeros([BLOCK], dtype=tl.int64) - 1
    # The probe distance as a [BLOCK] tensor (equal in every lane): the loop-carried mask then only ever meets
    # tensor compares. A Python-int distance makes `d + 1 < MAX_P` a Python bool, and `m_act & True` is an int
    # tensor, not a mask, under Triton 3.9's interpreter ("mask has unsupported dtype").
    b_d = tl.zeros([BLOCK], dtype=tl.int32)
    n_act = tl.sum(m_act.to(tl.int32), 0)
    while n_act > 0:
        b_p = (b_home + b_d) & MASK
        b_k = tl.load(p_keys + b_p, mask=m_act, other=-1)
        m_hit = m_act & (b_k >= 0) & ((b_k >> 30) == b_q)
        b_pos = tl.where(m_hit, b_p, b_pos)
        b_slot = tl.where(m_hit, b_k & 0x3FFFFFFF, b_slot)
        m_act = m_act & (m_hit == 0) & (b_k != -1) & (b_d + 1 < MAX_P)
        b_d += 1
        n_act = tl.sum(m_act.to(tl.int32), 0)
    tl.store(o_pos + o_i, b_pos, mask=m_i)
    tl.store(o_slot + o_i, b_slot, mask=m_i)


@triton.jit(do_not_specialize=["B"])
def index_insert_round_kernel(p_keys, p_entry, p_home, p_pend, p_dist, p_target, p_tdist, o_ok, B, H,
                              RESOLVE: tl.constexpr, MAX_P: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """RESOLVE: the claims of the last round are final; each proposer whose entry holds its target won, the
    others go on past the target. Then every pending key scans its next W positions for the first free one and
    records it as its target (-1: none)."""
    i_b = tl.program_id(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    m_pend = tl.load(p_pend + o_i, mask=m_i, other=0) != 0
    b_dist = tl.load(p_dist + o_i, mask=m_i, other=0)
    if RESOLVE:
        b_entry = tl.load(p_entry + o_i, mask=m_i, other=-1)
        b_t = tl.load(p_target + o_i, mask=m_i, other=-1)
        m_prop = m_pend & (b_t >= 0)
        b_at = tl.load(p_keys + b_t, mask=m_prop, other=-1)
        m_won = m_prop & (b_at == b_entry)
        m_lost = m_prop & (b_at != b_entry)
        tl.store(o_ok + o_i, m_won.to(tl.int8), mask=m_won)
        b_dist = tl.where(m_lost, tl.load(p_tdist + o_i, mask=m_lost, other=0) + 1, b_dist)
        m_pend = m_pend & (m_won == 0) & (b_dist < MAX_P)
    b_home = tl.load(p_home + o_i, mask=m_i, other=0)
    b_target = tl.zeros([BLOCK], dtype=tl.int64) - 1
    b_tdist = b_dist
    m_look = m_pend
    for j in tl.static_range(W):
        b_d = b_dist + j
        b_p = (b_home + b_d) & (H - 1)
        m_try = m_look & (b_d < MAX_P)
        b_k = tl.load(p_keys + b_p, mask=m_try, other=0)
        m_free = m_try & (b_k < 0)
        b_target = tl.where(m_free, b_p, b_target)
        b_tdist = tl.where(m_free, b_d, b_tdist)
        m_look = m_look & (m_free == 0)
    m_none = m_pend & (b_target < 0)
    b_dist = tl.where(m_none, b_dist + W, b_dist)
    m_pend = m_pend & (b_dist < MAX_P)
    tl.store(p_target + o_i, b_target, mask=m_i)
    tl.store(p_tdist + o_i, b_tdist, mask=m_i)
    tl.store(p_dist + o_i, b_dist, mask=m_i)
    tl.store(p_pend + o_i, m_pend.to(tl.int8), mask=m_i)


@triton.jit(do_not_specialize=["B"])
def index_claim_kernel(p_keys, p_entry, p_pend, p_target, B, BLOCK: tl.constexpr):
    """Every proposer claims its target; the largest entry (id) wins (atomic max: the same result in any order)."""
    i_b = tl.program_id(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    m_pend = tl.load(p_pend + o_i, mask=m_i, other=0) != 0
    b_t = tl.load(p_target + o_i, mask=m_i, other=-1)
    m_prop = m_pend & (b_t >= 0)
    b_entry = tl.load(p_entry + o_i, mask=m_prop, other=-1)
    tl.atomic_max(p_keys + b_t, b_entry, mask=m_prop, sem="relaxed")


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
    index_find_kernel[(triton.cdiv(B, BLOCK),)](
        keys, query.contiguous(), _n_tensor(n_query, query.device), pos, slot, B, keys.numel() - 1,
        MAX_P=MAX_PROBE, BLOCK=BLOCK)
    return pos, slot


def index_lookup_triton(keys, query, n_query, early_exit: bool = False):
    return index_find_triton(keys, query, n_query)[1]


def index_delete_triton(keys, ids, n, early_exit: bool = False) -> None:
    _tombstone(keys, index_find_triton(keys, ids, n)[0])


def index_insert_triton(keys, ids, slots, n, early_exit: bool = False) -> torch.Tensor:
    """Same table and ok mask as `index_insert_torch`: scan/claim rounds as kernels (two launches a round)."""
    B = ids.numel()
    dev = ids.device
    ok = torch.zeros(B, dtype=torch.int8, device=dev)
    if B == 0:
        return ok.bool()
    size = keys.numel()
    entry = pack(ids.clamp(min=0), slots.clamp(min=0)).contiguous()
    home = _home(ids, size).contiguous()
    pend = (_live_mask(B, n, dev) & (ids >= 0)).to(torch.int8)
    dist = torch.zeros(B, dtype=torch.int64, device=dev)
    target = torch.empty(B, dtype=torch.int64, device=dev)
    tdist = torch.empty(B, dtype=torch.int64, device=dev)
    BLOCK = _block(B, dev)
    grid = (triton.cdiv(B, BLOCK),)
    args = (keys, entry, home, pend, dist, target, tdist, ok, B, size)
    index_insert_round_kernel[grid](*args, RESOLVE=False, MAX_P=MAX_PROBE, W=PROBE_WINDOW, BLOCK=BLOCK)
    for _ in range(INSERT_ROUNDS):
        if early_exit and not bool(pend.any()):
            break
        index_claim_kernel[grid](keys, entry, pend, target, B, BLOCK=BLOCK)
        index_insert_round_kernel[grid](*args, RESOLVE=True, MAX_P=MAX_PROBE, W=PROBE_WINDOW, BLOCK=BLOCK)
    return ok.bool()


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


def index_insert(keys, ids, slots, n, early_exit: bool = False) -> torch.Tensor:
    if backend_for(ids.device) == "triton":
        with on_device(ids):
            return index_insert_triton(keys, ids, slots, n, early_exit)
    return index_insert_torch(keys, ids, slots, n, early_exit)
