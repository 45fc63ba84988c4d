"""Row gather/scatter between the host table and the device cache (admission and write-back).

One op serves both directions: `dst[dst_idx[i]] = src[src_idx[i]]` for i < n where both indices are >= 0
(`accumulate=True`: `+=`, for counts; the destinations must then be distinct). A negative index skips the row
(a clean victim, an unused buffer position), so callers pass fixed-capacity buffers with a device-side count
and never compact on the host; an index past the end of its tensor is skipped too, so no index can write or
read outside the tables. 1-D tensors are treated as [R, 1].
"""

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
from .lazy_triton import tl, triton

from . import host_rows
from .gather import put_rows
from .dispatch import backend_for, gpu_shapes, persistent_programs

ROW_COPY_MODES = ("zero_copy", "staged")


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 1 else t


def row_copy_mode() -> str:
    """How host<->cuda copies run: `CACHEDEMB_ROW_COPY=zero_copy` (default; the kernel addresses the pinned host
    table through UVA) or `staged` (host gather into a reused pinned buffer + async copy). Read at call time."""
    value = os.environ.get("CACHEDEMB_ROW_COPY", "").strip().lower() or "zero_copy"
    if value not in ROW_COPY_MODES:
        raise ValueError(f"CACHEDEMB_ROW_COPY={value!r}: expected one of {ROW_COPY_MODES} or unset")
    return value


def row_copy_torch(src, src_idx, dst, dst_idx, n, accumulate: bool = False):
    """Reference: boolean selection then index_copy (syncs on the host; fine for a reference)."""
    src2, dst2 = _as_rows(src), _as_rows(dst)
    if not accumulate and host_rows.copy_rows(src2, src_idx, dst2, dst_idx, n):
        return
    s, d = _copy_pairs(src_idx, dst_idx, n, src2.shape[0], dst2.shape[0])
    _copy_rows(src2, s, dst2, d, accumulate)


def _copy_pairs(src_idx, dst_idx, n, r_src: int, r_dst: int):
    """The (source, destination) row pairs row_copy copies: the first n, both in range."""
    m = min(int(n), src_idx.numel(), dst_idx.numel())
    s, d = src_idx[:m], dst_idx[:m].to(src_idx.device)
    sel = (s >= 0) & (d >= 0) & (s < r_src) & (d < r_dst)
    return s.masked_select(sel), d.masked_select(sel)  # = s[sel], d[sel]; faster on CPU


def _copy_rows(src2, s, dst2, d, accumulate: bool):
    """dst2[d[i]] = src2[s[i]] (or +=) for the selected pairs."""
    if s.numel() == 0:
        return
    if src2.device.type == dst2.device.type == "cpu" and src2.dtype == dst2.dtype:
        # into a reused scratch block: a fresh [n, D] gather page-faults its memory in on every call (~4x the
        # copy itself for a few MB)
        rows = torch.index_select(src2, 0, s, out=_CPU_SCRATCH.get(src2.dtype, s.numel(), src2.shape[1]))
    else:
        rows = src2.index_select(0, s.to(src2.device)).to(device=dst2.device, dtype=dst2.dtype)
    if accumulate:
        dst2.index_add_(0, d.to(dst2.device), rows)
    else:
        put_rows(dst2, d.to(dst2.device), rows)


@triton.jit(do_not_specialize=["n_cap", "R_src", "R_dst"])
def row_copy_kernel(p_src, p_src_idx, p_dst, p_dst_idx, n_ptr, n_cap, R_src, R_dst, D, s_src_r, s_src_d, s_dst_r,
                    s_dst_d, N_FROM_PTR: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """A [BLOCK_R, BLOCK_D] tile of copy pairs: dst[dst_idx[i], d] = src[src_idx[i], d] for i < n, both idx >= 0.
    n is min(*n_ptr, n_cap) with N_FROM_PTR, else n_cap. Either side may be pinned host memory (UVA)."""
    i_r, i_d = tl.program_id(0), tl.program_id(1)
    o_r = i_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = i_d.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_r = o_r < n_cap
    if N_FROM_PTR:
        m_r = m_r & (o_r < tl.load(n_ptr))
    b_s = tl.load(p_src_idx + o_r, mask=m_r, other=-1).to(tl.int64)
    b_t = tl.load(p_dst_idx + o_r, mask=m_r, other=-1).to(tl.int64)
    m_r = m_r & (b_s >= 0) & (b_t >= 0) & (b_s < R_src) & (b_t < R_dst)
    m = m_r[:, None] & (o_d < D)[None, :]
    b_x = tl.load(p_src + b_s[:, None] * s_src_r + o_d[None, :] * s_src_d, mask=m).to(p_dst.dtype.element_ty)
    p_out = p_dst + b_t[:, None] * s_dst_r + o_d[None, :] * s_dst_d
    if ACCUMULATE:
        b_x = b_x + tl.load(p_out, mask=m)
    tl.store(p_out, b_x, mask=m)


def row_copy_triton(src, src_idx, dst, dst_idx, n, accumulate: bool = False):
    """Same effect as `row_copy_torch`, no host sync when n is a device tensor. For host<->cuda copies the host
    side must be pinned (zero-copy); with `CACHEDEMB_ROW_COPY=staged` or an unpinned host side this goes through
    `row_copy_staged` instead."""
    src2, dst2 = _as_rows(src), _as_rows(dst)
    if src2.shape[1] != dst2.shape[1]:
        raise ValueError(f"row_copy: src has {src2.shape[1]} columns, dst {dst2.shape[1]}; they must match")
    if src2.device.type != dst2.device.type:
        host = src if src2.device.type == "cpu" else dst
        if row_copy_mode() == "staged" or not host.is_pinned():
            return row_copy_staged(src, src_idx, dst, dst_idx, n, accumulate)
    cuda = next((t.device for t in (src2, dst2, src_idx) if t.device.type == "cuda"), None)
    n_cap = min(src_idx.numel(), dst_idx.numel())
    if torch.is_tensor(n) and not (cuda is not None and n.device.type == "cpu"):
        n_ptr, from_ptr = n.reshape(1), True
    else:
        n_cap, n_ptr, from_ptr = min(n_cap, max(int(n), 0)), src_idx, False  # a CPU count is read for free
    D = src2.shape[1]
    if n_cap == 0 or D == 0:
        return
    if cuda is not None:
        src_idx, dst_idx, n_ptr = (t if t.is_cuda or t.is_pinned() else t.to(cuda) for t in (src_idx, dst_idx, n_ptr))
    if cuda is not None or gpu_shapes(src2.device):
        BLOCK_D = min(triton.next_power_of_2(D), 256)
        BLOCK_R = max(1, 2048 // BLOCK_D)
    else:  # the interpreter: few, large programs
        BLOCK_D = min(triton.next_power_of_2(D), 1024)
        BLOCK_R = min(max(1, 16384 // BLOCK_D), max(16, triton.next_power_of_2(n_cap)))
    grid = (triton.cdiv(n_cap, BLOCK_R), triton.cdiv(D, BLOCK_D))
    with torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext():
        row_copy_kernel[grid](src2, src_idx.contiguous(), dst2, dst_idx.contiguous(), n_ptr, n_cap, src2.shape[0],
                              dst2.shape[0], D, src2.stride(0), src2.stride(1), dst2.stride(0), dst2.stride(1),
                              N_FROM_PTR=from_ptr, ACCUMULATE=accumulate, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)


class _StagingBuffer:
    """One reused host buffer per (dtype, columns), pinned when CUDA exists; grows by doubling. `ready` is the event
    of the last async copy out of it, waited on before the host writes into it again."""

    def __init__(self):
        self.buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self.ready: dict[tuple[torch.dtype, int], torch.cuda.Event] = {}

    def get(self, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        key = (dtype, cols)
        event = self.ready.pop(key, None)
        if event is not None:
            event.synchronize()
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < rows * cols:
            size = triton.next_power_of_2(max(rows, 64)) * cols
            buf = torch.empty(size, dtype=dtype, pin_memory=torch.cuda.is_available())
            self.buffers[key] = buf
        return buf[: rows * cols].view(rows, cols)

    def record(self, dtype: torch.dtype, cols: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self.ready[(dtype, cols)] = event


_STAGING = _StagingBuffer()


class _ScratchRows(threading.local):
    """Reused CPU blocks per (dtype, columns) for the reference's row gathers, grown by doubling; one set per
    thread (a read-ahead thread copies too); never read after the call that filled it."""

    def __init__(self):
        self.buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def get(self, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        buf = self.buffers.get((dtype, cols))
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(triton.next_power_of_2(max(rows, 64)) * cols, dtype=dtype)
            self.buffers[(dtype, cols)] = buf
        return buf[: rows * cols].view(rows, cols)


_CPU_SCRATCH = _ScratchRows()


def row_copy_staged(src, src_idx, dst, dst_idx, n, accumulate: bool = False):
    """Fallback for host<->cuda copies: the pairs are read on the host (a sync), host rows are gathered into the
    reused staging buffer and copied asynchronously; rows for the host are gathered on the device, staged and
    scattered on the host after the copy lands (a sync). Works for any pair of devices."""
    src2, dst2 = _as_rows(src), _as_rows(dst)
    m = max(0, min(int(n), src_idx.numel(), dst_idx.numel()))
    s = src_idx[:m].to("cpu", torch.int64)
    d = dst_idx[:m].to("cpu", torch.int64)
    sel = (s >= 0) & (d >= 0) & (s < src2.shape[0]) & (d < dst2.shape[0])
    s, d = s.masked_select(sel), d.masked_select(sel)  # = s[sel], d[sel]; faster on CPU
    count, cols = s.numel(), src2.shape[1]
    if count == 0:
        return
    if src2.device.type == "cpu":
        rows = _STAGING.get(src2.dtype, count, cols)
        torch.index_select(src2, 0, s, out=rows)
        if dst2.device.type == "cuda":
            with torch.cuda.device(dst2.device):
                rows = rows.to(dst2.device, non_blocking=True)
                _STAGING.record(src2.dtype, cols)
    else:
        rows = src2.index_select(0, s.to(src2.device))
        if dst2.device.type == "cpu":
            staged = _STAGING.get(src2.dtype, count, cols)
            staged.copy_(rows)  # device -> host: waits for the copy, so the host scatter below reads landed rows
            rows = staged
    rows = rows.to(device=dst2.device, dtype=dst2.dtype)
    if accumulate:
        dst2.index_add_(0, d.to(dst2.device), rows)
    else:
        put_rows(dst2, d.to(dst2.device), rows)


def row_copy(src, src_idx, dst, dst_idx, n, accumulate: bool = False):
    """Copy rows src -> dst (or add them, `accumulate`). `n` is an int or a [1] tensor on the index device."""
    index_device = src_idx.device
    if backend_for(index_device) == "triton":
        return row_copy_triton(src, src_idx, dst, dst_idx, n, accumulate)
    return row_copy_torch(src, src_idx, dst, dst_idx, n, accumulate)


# ----------------------------------------------------------------------------------------- several tensors
MAX_COPIES = 4  # a row, two optimizer states and a count: what moves with one cache row


@dataclass(frozen=True)
class RowCopy:
    """One tensor pair of a multi-tensor copy: dst[dst_idx[i]] = src[src_idx[i]] (row_copy's rules)."""

    src: torch.Tensor
    src_idx: torch.Tensor
    dst: torch.Tensor
    dst_idx: torch.Tensor


def row_copy_many_torch(copies: list[RowCopy], n) -> None:
    """Reference: row_copy_torch per pair; pairs with the same index tensors (and table lengths) select their
    rows once."""
    selected = {}
    for c in copies:
        src2, dst2 = _as_rows(c.src), _as_rows(c.dst)
        if host_rows.copy_rows(src2, c.src_idx, dst2, c.dst_idx, n):
            continue
        key = (id(c.src_idx), id(c.dst_idx), src2.shape[0], dst2.shape[0])
        if key not in selected:
            selected[key] = _copy_pairs(c.src_idx, c.dst_idx, n, src2.shape[0], dst2.shape[0])
        s, d = selected[key]
        _copy_rows(src2, s, dst2, d, False)


@triton.jit
def copy_block(src, src_idx, dst, dst_idx, R_src, R_dst, D, o_r, m_r, BLOCK_D: tl.constexpr):
    """Rows o_r (mask m_r) of one pair, all D columns in BLOCK_D steps; contiguous rows."""
    b_s = tl.load(src_idx + o_r, mask=m_r, other=-1).to(tl.int64)
    b_t = tl.load(dst_idx + o_r, mask=m_r, other=-1).to(tl.int64)
    m_r = m_r & (b_s >= 0) & (b_t >= 0) & (b_s < R_src) & (b_t < R_dst)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m = m_r[:, None] & (o_d < D)[None, :]
        b_x = tl.load(src + b_s[:, None] * D + o_d[None, :], mask=m)
        tl.store(dst + b_t[:, None] * D + o_d[None, :], b_x.to(dst.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_cap", "R_src0", "R_dst0", "R_src1", "R_dst1", "R_src2", "R_dst2", "R_src3",
                               "R_dst3"])
def row_copy_many_kernel(
    n_ptr,  # [1] int64 pairs to copy (N_FROM_PTR), else unused
    n_cap,  # static bound on the pairs
    src0, src_idx0, dst0, dst_idx0, R_src0, R_dst0, D0,
    src1, src_idx1, dst1, dst_idx1, R_src1, R_dst1, D1,
    src2, src_idx2, dst2, dst_idx2, R_src2, R_dst2, D2,
    src3, src_idx3, dst3, dst_idx3, R_src3, R_dst3, D3,
    N_COPIES: tl.constexpr,
    N_FROM_PTR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BD0: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr,
):
    """Up to four tensor pairs in one launch. Persistent programs loop over blocks of BLOCK_R pairs up to the
    count read on the device (min(n, n_cap)); each block copies its rows of every pair."""
    n = n_cap
    if N_FROM_PTR:
        n = tl.minimum(tl.load(n_ptr), n_cap)
    blk = tl.program_id(0).to(tl.int64)
    while blk * BLOCK_R < n:
        o_r = blk * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        m_r = o_r < n
        copy_block(src0, src_idx0, dst0, dst_idx0, R_src0, R_dst0, D0, o_r, m_r, BD0)
        if N_COPIES > 1:
            copy_block(src1, src_idx1, dst1, dst_idx1, R_src1, R_dst1, D1, o_r, m_r, BD1)
        if N_COPIES > 2:
            copy_block(src2, src_idx2, dst2, dst_idx2, R_src2, R_dst2, D2, o_r, m_r, BD2)
        if N_COPIES > 3:
            copy_block(src3, src_idx3, dst3, dst_idx3, R_src3, R_dst3, D3, o_r, m_r, BD3)
        blk += tl.num_programs(0)


def _zero_copy_ok(c: RowCopy) -> bool:
    src2, dst2 = _as_rows(c.src), _as_rows(c.dst)
    if not (src2.is_contiguous() and dst2.is_contiguous()) or src2.shape[1] != dst2.shape[1]:
        return False
    if src2.device.type != dst2.device.type:
        host = c.src if src2.device.type == "cpu" else c.dst
        return row_copy_mode() == "zero_copy" and host.is_pinned()
    return True


def row_copy_many_triton(copies: list[RowCopy], n) -> None:
    """All pairs in ceil(len / 4) launches; pairs the kernel cannot address (strided, an unpinned host side,
    `CACHEDEMB_ROW_COPY=staged`) go through row_copy one by one."""
    direct = [c for c in copies if _zero_copy_ok(c)]
    for c in copies:
        if not _zero_copy_ok(c):
            row_copy_triton(c.src, c.src_idx, c.dst, c.dst_idx, n)
    for i in range(0, len(direct), MAX_COPIES):
        _launch_many(direct[i:i + MAX_COPIES], n)


def _launch_many(copies: list[RowCopy], n) -> None:
    cuda = next((t.device for c in copies for t in (c.src, c.dst, c.src_idx) if t.device.type == "cuda"), None)
    n_cap = min(min(c.src_idx.numel(), c.dst_idx.numel()) for c in copies)
    if torch.is_tensor(n) and not (cuda is not None and n.device.type == "cpu"):
        n_ptr, from_ptr = n.reshape(1), True
    else:
        n_cap, n_ptr, from_ptr = min(n_cap, max(int(n), 0)), copies[0].src_idx, False  # a CPU count: free
    if n_cap == 0:
        return
    args, blocks = [], []
    for c in copies + [copies[0]] * (MAX_COPIES - len(copies)):
        src2, dst2 = _as_rows(c.src), _as_rows(c.dst)
        src_idx, dst_idx = c.src_idx.contiguous(), c.dst_idx.contiguous()
        if cuda is not None:
            src_idx, dst_idx = (t if t.is_cuda or t.is_pinned() else t.to(cuda) for t in (src_idx, dst_idx))
        args += [src2, src_idx, dst2, dst_idx, src2.shape[0], dst2.shape[0], src2.shape[1]]
        blocks.append(max(1, min(triton.next_power_of_2(src2.shape[1]), 128)))
    if cuda is not None and n_ptr.device.type == "cpu" and not n_ptr.is_pinned():
        n_ptr = n_ptr.to(cuda)
    if cuda is not None or gpu_shapes(copies[0].src_idx.device):
        block_r = max(16, 2048 // max(blocks))
    else:  # the interpreter: few, large programs
        block_r = min(4096, max(16, triton.next_power_of_2(n_cap)))
    grid = (persistent_programs(cuda or copies[0].src_idx.device, triton.cdiv(n_cap, block_r)),)
    with torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext():
        row_copy_many_kernel[grid](n_ptr, n_cap, *args, N_COPIES=len(copies), N_FROM_PTR=from_ptr,
                                   BLOCK_R=block_r, BD0=blocks[0], BD1=blocks[1], BD2=blocks[2], BD3=blocks[3],
                                   num_warps=4)


def row_copy_many(copies: list[RowCopy], n) -> None:
    """Several row copies sharing one count `n` (an int or a [1] tensor on the index device), in one launch
    where the kernel can address every pair: a cache row's weights, optimizer states and count move together."""
    if not copies:
        return
    if backend_for(copies[0].src_idx.device) == "triton":
        return row_copy_many_triton(copies, n)
    return row_copy_many_torch(copies, n)


# ----------------------------------------------------------------------------------------- one admission's moves
MAX_MOVE_PAIRS = 3  # a row and up to two optimizer states (the count moves on its own)


def row_move_torch(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest, n_miss,
                   add=None) -> None:
    """Reference: an admission's row moves (RowMove's), out then in. `pairs` = [(device tensor, host tensor)] that
    move with a row. For r < n_admit: the dirty victim's rows and state go to host row dirty_ids[r] and its count
    to host_freq[old_ids[r]]; then for r < n_miss the rows of miss_ids[r] come into slot miss_dest[r] (-1: none),
    with their count (+ add[r], the batch's own lookups, when given)."""
    copies = [RowCopy(d, victims, h, dirty_ids) for d, h in pairs]
    row_copy_many_torch(copies + [RowCopy(slot_freq, victims, host_freq, old_ids)], n_admit)
    copies = [RowCopy(h, miss_ids, d, miss_dest) for d, h in pairs]
    row_copy_many_torch(copies + [RowCopy(host_freq, miss_ids, slot_freq, miss_dest)], n_miss)
    if add is not None:
        m = min(int(n_miss), miss_dest.numel())
        dest, extra = miss_dest[:m], add[:m]
        keep = dest >= 0
        slot_freq.index_add_(0, dest[keep], extra[keep].to(slot_freq.dtype))


@triton.jit
def move_rows(p_dev, p_host, D, R_dev, R_host, b_v, m_out, b_dirty, b_dest, m_in, b_mid, BLOCK_D: tl.constexpr):
    """Rows of one (device, host) pair: victim row b_v to host row b_dirty (m_out), then host row b_mid into slot
    b_dest (m_in); an element is moved out and in by the same thread, in this order (the tiles match)."""
    m_out = m_out & (b_v < R_dev) & (b_dirty < R_host)
    m_in = m_in & (b_dest < R_dev) & (b_mid < R_host)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m_t = m_out[:, None] & (o_d < D)[None, :]
        b_x = tl.load(p_dev + b_v[:, None] * D + o_d[None, :], mask=m_t)
        tl.store(p_host + b_dirty[:, None] * D + o_d[None, :], b_x, mask=m_t)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m_t = m_in[:, None] & (o_d < D)[None, :]
        b_y = tl.load(p_host + b_mid[:, None] * D + o_d[None, :], mask=m_t)
        tl.store(p_dev + b_dest[:, None] * D + o_d[None, :], b_y, mask=m_t)


@triton.jit(do_not_specialize=["cap", "R_dev", "R_host"])
def row_move_kernel(p_n_admit, p_n_miss, cap, p_victims, p_old, p_dirty_ids, p_miss_ids, p_miss_dest, p_add,
                    p_slot_freq, p_host_freq, R_dev, R_host, dev0, host0, D0, dev1, host1, D1, dev2, host2, D2,
                    N_PAIRS: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_R: tl.constexpr, BD0: tl.constexpr,
                    BD1: tl.constexpr, BD2: tl.constexpr):
    """Persistent programs over the ranks up to the device counts; rank r moves victim r out and miss r in."""
    n_admit = tl.minimum(tl.load(p_n_admit), cap)
    n_miss = tl.minimum(tl.load(p_n_miss), cap)
    blk = tl.program_id(0).to(tl.int64)
    while blk * BLOCK_R < tl.maximum(n_admit, n_miss):
        o_r = blk * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        m_a = o_r < n_admit
        m_r = o_r < n_miss
        b_v = tl.load(p_victims + o_r, mask=m_a, other=0)
        b_old = tl.load(p_old + o_r, mask=m_a, other=-1)
        b_dirty = tl.load(p_dirty_ids + o_r, mask=m_a, other=-1)
        b_dest = tl.load(p_miss_dest + o_r, mask=m_r, other=-1)
        b_mid = tl.load(p_miss_ids + o_r, mask=m_r, other=-1)
        m_out = m_a & (b_dirty >= 0) & (b_v >= 0)
        m_in = m_r & (b_dest >= 0) & (b_mid >= 0)
        move_rows(dev0, host0, D0, R_dev, R_host, b_v, m_out, b_dirty, b_dest, m_in, b_mid, BD0)
        if N_PAIRS > 1:
            move_rows(dev1, host1, D1, R_dev, R_host, b_v, m_out, b_dirty, b_dest, m_in, b_mid, BD1)
        if N_PAIRS > 2:
            move_rows(dev2, host2, D2, R_dev, R_host, b_v, m_out, b_dirty, b_dest, m_in, b_mid, BD2)
        m_cnt = m_a & (b_old >= 0) & (b_old < R_host) & (b_v >= 0) & (b_v < R_dev)
        b_f = tl.load(p_slot_freq + b_v, mask=m_cnt)
        tl.store(p_host_freq + b_old, b_f, mask=m_cnt)
        m_in = m_in & (b_dest < R_dev) & (b_mid < R_host)
        b_g = tl.load(p_host_freq + b_mid, mask=m_in)
        if HAS_ADD:
            b_g += tl.load(p_add + o_r, mask=m_in, other=0)
        tl.store(p_slot_freq + b_dest, b_g, mask=m_in)
        blk += tl.num_programs(0)


def row_move_fused_triton(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest,
                          n_miss, add=None) -> None:
    """row_move_torch in one launch, out and in interleaved rank by rank (`CACHEDEMB_ROW_MOVE=fused`; kept for the
    row-move benchmark beside the split launches). Every pair contiguous; host tables pinned on CUDA."""
    if len(pairs) > MAX_MOVE_PAIRS or not all(d.is_contiguous() and h.is_contiguous() for d, h in pairs):
        return row_move_torch(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest,
                              n_miss, add)
    dev = victims.device
    cap = min(victims.numel(), miss_ids.numel(), miss_dest.numel())
    if cap == 0:
        return
    n_admit, n_miss = (_count_tensor(n, dev) for n in (n_admit, n_miss))
    args, blocks = [], []
    for d, h in list(pairs) + [pairs[0]] * (MAX_MOVE_PAIRS - len(pairs)):
        d2, h2 = _as_rows(d), _as_rows(h)
        args += [d2, h2, d2.shape[1]]
        blocks.append(max(1, min(triton.next_power_of_2(d2.shape[1]), 128)))
    if gpu_shapes(dev):  # 1024-element tiles: four index vectors stay live across the pairs' loops (8 warps for
        block_r = max(8, 1024 // max(blocks))  # two or three pairs: with 4, Triton 3.6 spilled three pairs on sm_90)
    else:  # the interpreter: few, large programs
        block_r = min(4096, max(16, triton.next_power_of_2(cap)))
    grid = (persistent_programs(dev, triton.cdiv(cap, block_r)),)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        row_move_kernel[grid](n_admit.reshape(1), n_miss.reshape(1), cap, victims, old_ids, dirty_ids, miss_ids,
                              miss_dest, add if add is not None else old_ids, slot_freq, host_freq,
                              _as_rows(pairs[0][0]).shape[0], _as_rows(pairs[0][1]).shape[0], *args,
                              N_PAIRS=len(pairs), HAS_ADD=add is not None, BLOCK_R=block_r, BD0=blocks[0],
                              BD1=blocks[1], BD2=blocks[2], num_warps=8 if len(pairs) > 1 else 4)


def _count_tensor(n, device) -> torch.Tensor:
    return n if torch.is_tensor(n) else torch.full((1,), int(n), dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------- split row moves
ROW_MOVE_MODES = ("split", "fused")
ROW_TILE = 4096  # elements a row program copies per pass over its pairs: 16 KiB of fp32 in flight per program
COUNT_BLOCK = 512  # counts a count program moves per pass
ROWS_PER_PASS = 64  # at most: the index vectors of a pass stay live across the pairs' loops


def row_move_mode() -> str:
    """How row_move launches on the Triton backend: `CACHEDEMB_ROW_MOVE=split` (default: rows out, then rows in,
    two launches whose programs copy rows only, the counts in programs of their own) or `fused` (one launch, out
    and in interleaved per rank). Read at call time."""
    value = os.environ.get("CACHEDEMB_ROW_MOVE", "").strip().lower() or "split"
    if value not in ROW_MOVE_MODES:
        raise ValueError(f"CACHEDEMB_ROW_MOVE={value!r}: expected one of {ROW_MOVE_MODES} or unset")
    return value


@triton.jit
def stream_rows(p_src, p_dst, D, b_s, b_t, m_r, BD: tl.constexpr):
    """dst[b_t] = src[b_s] for the rows of m_r, all D columns in BD steps. Where D is a multiple of 16 (Triton
    specializes it so) every row starts 16-element aligned and a thread moves 16 bytes per access (v4)."""
    r_s = b_s[:, None] * D
    r_t = b_t[:, None] * D
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD).to(tl.int64)
        m = m_r[:, None] & (o_d < D)[None, :]
        b_x = tl.load(p_src + r_s + o_d[None, :], mask=m)
        tl.store(p_dst + r_t + o_d[None, :], b_x.to(p_dst.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["cap", "row_programs", "R_src", "R_dst", "R_csrc", "R_cdst"])
def row_stream_kernel(p_n, cap, row_programs, p_src_idx, p_dst_idx, R_src, R_dst,
                      src0, dst0, D0, src1, dst1, D1, src2, dst2, D2,
                      p_csrc_idx, p_cdst_idx, p_csrc, p_cdst, R_csrc, R_cdst, p_add,
                      N_PAIRS: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_ADD: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BD0: tl.constexpr, BD1: tl.constexpr,
                      BD2: tl.constexpr):
    """One direction of a row move, up to the count *p_n (<= cap). Programs below `row_programs` copy the rows of
    every pair (dst_k[dst_idx[r]] = src_k[src_idx[r]]), persistent over blocks of BLOCK_R ranks; the others move
    the counts (cdst[cdst_idx[r]] = csrc[csrc_idx[r]] (+ add[r])), so no row program waits on a scattered 8-byte
    access. A negative or out-of-range index skips its rank."""
    n = tl.minimum(tl.load(p_n), cap)
    pid = tl.program_id(0)
    if pid < row_programs:
        blk = pid.to(tl.int64)
        while blk * BLOCK_R < n:
            o_r = blk * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
            m_r = o_r < n
            b_s = tl.load(p_src_idx + o_r, mask=m_r, other=-1).to(tl.int64)
            b_t = tl.load(p_dst_idx + o_r, mask=m_r, other=-1).to(tl.int64)
            m_r = m_r & (b_s >= 0) & (b_t >= 0) & (b_s < R_src) & (b_t < R_dst)
            stream_rows(src0, dst0, D0, b_s, b_t, m_r, BD0)
            if N_PAIRS > 1:
                stream_rows(src1, dst1, D1, b_s, b_t, m_r, BD1)
            if N_PAIRS > 2:
                stream_rows(src2, dst2, D2, b_s, b_t, m_r, BD2)
            blk += row_programs
    else:
        if HAS_COUNTS:
            blk = (pid - row_programs).to(tl.int64)
            step = tl.num_programs(0) - row_programs
            while blk * BLOCK_C < n:
                o_r = blk * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
                m_r = o_r < n
                b_s = tl.load(p_csrc_idx + o_r, mask=m_r, other=-1).to(tl.int64)
                b_t = tl.load(p_cdst_idx + o_r, mask=m_r, other=-1).to(tl.int64)
                m_r = m_r & (b_s >= 0) & (b_t >= 0) & (b_s < R_csrc) & (b_t < R_cdst)
                b_c = tl.load(p_csrc + b_s, mask=m_r)
                if HAS_ADD:
                    b_c += tl.load(p_add + o_r, mask=m_r, other=0)
                tl.store(p_cdst + b_t, b_c, mask=m_r)
                blk += step


def _launch_stream(pairs, src_idx, dst_idx, n, cap, counts=None) -> None:
    """One direction: `pairs` = [(src, dst)] of equal row counts per side, rows dst[dst_idx[r]] = src[src_idx[r]];
    `counts` = (csrc, csrc_idx, cdst, cdst_idx, add or None) moved by programs of their own."""
    dev = src_idx.device
    args, blocks = [], []
    for s, t in list(pairs) + [pairs[0]] * (MAX_MOVE_PAIRS - len(pairs)):
        s2, t2 = _as_rows(s), _as_rows(t)
        args += [s2, t2, s2.shape[1]]
        blocks.append(max(1, min(triton.next_power_of_2(s2.shape[1]), 128)))
    if gpu_shapes(dev):
        # rows whose length is no multiple of 16 load element by element, each with its own 64-bit address: a
        # quarter of the tile keeps those in registers
        widest = max(range(len(pairs)), key=lambda i: blocks[i])
        tile = ROW_TILE if _as_rows(pairs[widest][0]).shape[1] % 16 == 0 else ROW_TILE // 4
        block_r = max(4, min(ROWS_PER_PASS, tile // max(blocks)))
        block_c = COUNT_BLOCK
        programs = persistent_programs(dev, triton.cdiv(cap, block_r))
        count_programs = 0 if counts is None else max(1, min(programs // 8, triton.cdiv(cap, block_c)))
    else:  # the interpreter: few, large programs
        block_r = min(max(16, 16384 // max(blocks)), max(16, triton.next_power_of_2(cap)))
        block_c = min(4096, max(16, triton.next_power_of_2(cap)))
        programs = persistent_programs(dev, triton.cdiv(cap, block_r))
        count_programs = 0 if counts is None else 2
    r_src, r_dst = _as_rows(pairs[0][0]).shape[0], _as_rows(pairs[0][1]).shape[0]
    if counts is None:
        c_args = [src_idx, dst_idx, src_idx, dst_idx, 0, 0, src_idx]
    else:
        csrc, csrc_idx, cdst, cdst_idx, add = counts
        c_args = [csrc_idx, cdst_idx, csrc, cdst, csrc.shape[0], cdst.shape[0], add if add is not None else csrc_idx]
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        row_stream_kernel[(programs + count_programs,)](
            n.reshape(1), cap, programs, src_idx, dst_idx, r_src, r_dst, *args, *c_args,
            N_PAIRS=len(pairs), HAS_COUNTS=counts is not None, HAS_ADD=counts is not None and counts[4] is not None,
            BLOCK_R=block_r, BLOCK_C=block_c, BD0=blocks[0], BD1=blocks[1], BD2=blocks[2], num_warps=4)


def row_move_split_triton(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest,
                          n_miss, add=None) -> None:
    """row_move_torch in two launches on the current stream, out then in (stream order keeps a victim's slot read
    before its new row lands): the dirty victims' rows and every victim's count to the host, then the misses'
    rows and counts (+ add) in. Every pair contiguous; host tables pinned where the device is CUDA."""
    if len(pairs) > MAX_MOVE_PAIRS or not all(d.is_contiguous() and h.is_contiguous() for d, h in pairs):
        return row_move_torch(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest,
                              n_miss, add)
    dev = victims.device
    n_admit, n_miss = (_count_tensor(n, dev) for n in (n_admit, n_miss))
    cap_out = min(victims.numel(), dirty_ids.numel(), old_ids.numel())
    if cap_out:
        _launch_stream([(d, h) for d, h in pairs], victims, dirty_ids, n_admit, cap_out,
                       counts=(slot_freq, victims, host_freq, old_ids, None))
    cap_in = min(miss_ids.numel(), miss_dest.numel())
    if cap_in:
        _launch_stream([(h, d) for d, h in pairs], miss_ids, miss_dest, n_miss, cap_in,
                       counts=(host_freq, miss_ids, slot_freq, miss_dest, add))


def row_move_triton(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest, n_miss,
                    add=None) -> None:
    """row_move_torch on the Triton backend, split (default) or fused by `row_move_mode()`."""
    fn = row_move_split_triton if row_move_mode() == "split" else row_move_fused_triton
    return fn(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest, n_miss, add)


def row_move(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest, n_miss,
             add=None) -> None:
    if backend_for(victims.device) == "triton" and (victims.device.type == "cpu" or row_copy_mode() == "zero_copy"):
        return row_move_triton(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest,
                               n_miss, add)
    return row_move_torch(pairs, slot_freq, host_freq, victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest,
                          n_miss, add)
