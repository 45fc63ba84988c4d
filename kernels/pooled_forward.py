"""Pooled forward (sum / mean / max) over cache rows.

Inputs for B lookups in `bags` bags: `rows [R, D]` (cache rows, fp32/bf16/fp16/fp64), `loc_u [U]` (the row of each
unique id), `inverse [B]` (each lookup's unique position; -1 = padding lookup, excluded from pooling and from
the mean's count), `offsets [bags + 1]` (bag b is lookups offsets[b]:offsets[b+1]; offsets[-1] == B),
`per_sample_weights [B]` (sum mode only). Accumulation is fp32 (fp64 for an fp64 table, `acc_dtype`); the output
has rows' dtype.
Max mode also returns `max_pos [bags, D]`: the lookup position holding each element's maximum (first one on
ties, as torch), -1 for a bag with no non-padding lookup, whose output is 0.
"""

import struct

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device, soft_rtne

MODE_SUM, MODE_MEAN, MODE_MAX = 0, 1, 2
MODES = {"sum": MODE_SUM, "mean": MODE_MEAN, "max": MODE_MAX}
# Row locations: >= 0 a cache slot; -1 none (padding, or past the live unique ids); <= HOST_LOC the host-table
# row HOST_LOC - loc, read (and, in the fused backward, updated) in place through pinned memory: misses that
# find no free cache slot are served that way, so no device buffer ever grows with the batch.
HOST_LOC = -2


def host_loc(x: torch.Tensor) -> torch.Tensor:
    """Host row id -> location code, and back (the map is its own inverse)."""
    return HOST_LOC - x


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the references and the kernels: fp64 for an fp64 table, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc_dtype(dtype: torch.dtype):
    """`acc_dtype` as the Triton dtype the launchers pass as a kernel's ACC constexpr."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def double_bits(x: float) -> int:
    """A host scalar as the int64 bits of its double, for fp64 kernel math (`scalar_of_bits`): Triton passes a
    Python float as fp32, which would round an fp64 table's learning rate."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def lookup_rows_of(loc_u: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The row each lookup reads; padding lookups (and a batch with no unique id at all) point at row 0, which
    the caller masks out."""
    if loc_u.numel() == 0:
        return torch.zeros_like(inverse)
    return loc_u.index_select(0, inverse.clamp(min=0)).clamp(min=0)  # index_select: CPU's fast gather


def with_host_rows(rows, loc_u, host_rows, spare=None):
    """Reference helper: (table, loc) where rows served from the host (loc <= -2, see HOST_LOC) are appended
    to the cache rows, so the reference ops index one table. Reads the locations on the host. `spare`: a buffer
    whose first rows are `rows` (same memory) with room after them: the host rows are gathered there, sparing a
    fresh [rows + host rows, D] table (and its page faults) per batch."""
    if host_rows is None or loc_u.numel() == 0:
        return rows, loc_u
    on_host = loc_u <= HOST_LOC
    if not bool(on_host.any()):
        return rows, loc_u
    host_ids = host_loc(loc_u[on_host]).to(host_rows.device)
    C, n = rows.shape[0], host_ids.numel()
    remapped = loc_u.clone()
    remapped[on_host] = C + torch.arange(n, device=loc_u.device)
    if spare is not None and spare.shape[0] >= C + n and spare.data_ptr() == rows.data_ptr() and \
            spare.dtype == rows.dtype == host_rows.dtype and spare.device == rows.device == host_rows.device:
        table = spare[:C + n]
        torch.index_select(host_rows, 0, host_ids, out=table[C:])
        return table, remapped
    extra = host_rows.index_select(0, host_ids).to(device=rows.device, dtype=rows.dtype)
    return torch.cat([rows, extra]), remapped


def pooled_forward_torch(rows, loc_u, inverse, offsets, mode: int, per_sample_weights=None, host_rows=None,
                         spare=None):
    """Reference: torch.embedding_bag on the rows each lookup reads. fp32 sum/mean read the cache rows in
    place (padding lookups get weight 0, and mean becomes a weighted sum); max and half precision gather the
    lookups' rows (in fp32) and pool them with an appended zero pad row. `spare`: see with_host_rows."""
    rows, loc_u = with_host_rows(rows, loc_u, host_rows, spare)
    if mode != MODE_MAX and rows.dtype in (torch.float32, torch.float64):
        return _pooled_in_place(rows, loc_u, inverse, offsets, mode, per_sample_weights), None
    n_lookups = inverse.numel()
    valid = inverse >= 0
    lookup_rows = lookup_rows_of(loc_u, inverse)
    acc = acc_dtype(rows.dtype)
    gathered = rows.index_select(0, lookup_rows.to(rows.device)).to(acc)
    table = torch.cat([gathered, gathered.new_zeros(1, rows.shape[1])])
    positions = torch.arange(n_lookups, device=inverse.device)
    idx = torch.where(valid, positions, torch.full_like(positions, n_lookups)).to(rows.device)
    psw = per_sample_weights.to(acc) if per_sample_weights is not None else None
    out, _, bag_size, max_idx = torch.embedding_bag(
        table, idx, offsets[:-1].to(rows.device), False, mode, False, psw, False, n_lookups
    )
    out = out.to(rows.dtype)
    if mode != MODE_MAX:
        return out, None
    empty = (bag_size == 0).unsqueeze(1)
    max_pos = torch.where(empty, torch.full_like(max_idx, -1), max_idx)
    return out, max_pos


def _pooled_in_place(rows, loc_u, inverse, offsets, mode, per_sample_weights):
    idx = lookup_rows_of(loc_u, inverse)
    valid = inverse >= 0
    starts = offsets[:-1]
    if bool(valid.all()):
        psw = per_sample_weights.to(rows.dtype) if per_sample_weights is not None else None
        return torch.embedding_bag(rows, idx, starts, False, mode, False, psw, False, None)[0]
    weight = valid.to(rows.dtype)
    if per_sample_weights is not None:
        weight = weight * per_sample_weights.to(rows.dtype)
    if mode == MODE_MEAN:
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                      output_size=inverse.numel())
        count = torch.zeros(lengths.numel(), device=offsets.device, dtype=rows.dtype).index_add_(
            0, bag, valid.to(rows.dtype))
        weight = weight / count.clamp(min=1)[bag]
    return torch.embedding_bag(rows, idx, starts, False, MODE_SUM, False, weight, False, None)[0]


@triton.jit
def cast_to(b_x, dtype: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """fp32 -> dtype. SOFT_RTNE rounds fp32 -> bf16 to nearest-even with integer ops: Triton's CPU interpreter
    truncates that cast, the GPU rounds it (as torch does)."""
    if SOFT_RTNE and dtype == tl.bfloat16:
        b_u = b_x.to(tl.uint32, bitcast=True)
        b_u = (b_u + 0x7FFF + ((b_u >> 16) & 1)) >> 16
        b_u = tl.where(b_x != b_x, 0x7FC0, b_u)
        return b_u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return b_x.to(dtype)


@triton.jit
def scalar_of_bits(bits, ACC: tl.constexpr):
    """A scalar passed as the int64 bits of its double (`double_bits`), as an ACC value (exact in fp64). Under the
    interpreter an int that fits arrives as int32 (the bits of 0.0): widened first."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(ACC)


@triton.jit
def ieee_div(x, y):
    """x / y rounded to nearest in x's dtype (fp32 or fp64), as torch: tl.math.div_rn takes fp32 only, and a
    plain `/` is approximate in fp32 on the GPU but IEEE (div.rn.f64) in fp64."""
    if x.dtype == tl.float64:
        return x / y
    else:
        return tl.math.div_rn(x, y)


@triton.jit
def ieee_sqrt(x):
    """sqrt rounded to nearest in x's dtype (fp32 or fp64): tl.math.sqrt_rn takes fp32 only; fp64 tl.sqrt lowers
    to the IEEE sqrt.rn.f64."""
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.math.sqrt_rn(x)


@triton.jit
def pooled_forward_kernel(
    rows,  # [R, D] cache rows
    host_rows,  # [N, D] host table (pinned; rows at loc <= -2), same dtype
    loc_u,  # [U] int64 row of each unique id
    inverse,  # [B] int64 unique position of each lookup, -1 = padding
    offsets,  # [n_bags + 1] int64
    psw,  # [B] per-sample weights (sum mode; unused unless HAS_PSW)
    out,  # [n_bags, D] rows' dtype
    max_pos,  # [n_bags, D] int64 (max mode only)
    o_bag,  # [B] int64: each lookup's bag (STORE_BAG), for the backward
    o_count,  # [n_bags] ACC: each bag's non-padding lookups, at least 1 (STORE_COUNT), for a mean's backward
    n_bags,
    D,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MODE: tl.constexpr,
    HAS_PSW: tl.constexpr,
    SOFT_RTNE: tl.constexpr,
    ACC: tl.constexpr,
    STORE_BAG: tl.constexpr,
    STORE_COUNT: tl.constexpr,
):
    """A [BLOCK_B bags, BLOCK_D columns] tile: step t adds lookup t of every bag of the tile (bags shorter than
    t are masked), so each bag still sums in lookup order, the same order as torch.embedding_bag. Several bags
    per program keep the lanes busy when D is small."""
    i_b, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    m_b = o_b < n_bags
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < D
    bos = tl.load(offsets + o_b, mask=m_b, other=0).to(tl.int64)
    eos = tl.load(offsets + o_b + 1, mask=m_b, other=0).to(tl.int64)
    b_acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=ACC)
    b_pos = tl.full([BLOCK_B, BLOCK_D], -1, dtype=tl.int64)
    n_valid = tl.zeros([BLOCK_B], dtype=tl.int32)
    m_col0 = (tl.zeros_like(o_b) + i_d) == 0  # a tensor compare: Triton 3.9's interpreter refuses scalar masks
    for t in range(0, tl.max(eos - bos, axis=0)):
        o_i = bos + t
        if STORE_BAG:
            tl.store(o_bag + o_i, o_b, mask=m_b & (o_i < eos) & m_col0)
        b_u = tl.load(inverse + o_i, mask=m_b & (o_i < eos), other=-1)
        m_v = b_u >= 0
        b_r = tl.load(loc_u + tl.maximum(b_u, 0), mask=m_v, other=0).to(tl.int64)
        m_h, m_c = m_v & (b_r <= -2), m_v & (b_r > -2)
        b_xc = tl.load(rows + tl.maximum(b_r, 0)[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :],
                       other=0.0)
        b_xh = tl.load(host_rows + tl.maximum(-2 - b_r, 0)[:, None] * D + o_d[None, :],
                       mask=m_h[:, None] & m_d[None, :], other=0.0)
        b_x = tl.where(m_h[:, None], b_xh, b_xc).to(ACC)
        if MODE == 2:
            # first maximal lookup wins (strict >), the bag's first valid lookup always seeds
            m_upd = m_v[:, None] & ((n_valid == 0)[:, None] | (b_x > b_acc))
            b_acc = tl.where(m_upd, b_x, b_acc)
            b_pos = tl.where(m_upd, o_i[:, None], b_pos)
        else:
            if HAS_PSW:
                b_x = b_x * tl.load(psw + o_i, mask=m_v, other=0.0).to(ACC)[:, None]
            b_acc = b_acc + b_x  # masked lookups add +0.0: the sum's bits are unchanged
        n_valid += m_v.to(tl.int32)
    if MODE == 1:
        b_acc = ieee_div(b_acc, tl.maximum(n_valid, 1).to(ACC)[:, None])  # IEEE division, as torch
    if STORE_COUNT:
        tl.store(o_count + o_b, tl.maximum(n_valid, 1).to(ACC), mask=m_b & m_col0)
    m_t = m_b[:, None] & m_d[None, :]
    p_out = out + o_b[:, None] * D + o_d[None, :]
    tl.store(p_out, cast_to(b_acc, p_out.dtype.element_ty, SOFT_RTNE), mask=m_t)
    if MODE == 2:
        tl.store(max_pos + o_b[:, None] * D + o_d[None, :], b_pos, mask=m_t)


def _forward_block_d(dim: int) -> int:
    return min(triton.next_power_of_2(dim), 128)


def forward_bags_per_program(block_d: int, device: torch.device) -> int:
    """Bags one program pools: 1 from 64 columns on; below, enough bags for a 256-element tile on the GPU (a
    warp's lanes each load a 4-element vector of some bag), 1024 under the interpreter (fewer programs)."""
    if block_d >= 64:
        return 1
    return min(64, (256 if gpu_shapes(device) else 1024) // block_d)


def pooled_forward_triton(rows, loc_u, inverse, offsets, mode: int, per_sample_weights=None, host_rows=None,
                          bag_out=None, count_out=None):
    """Triton path of pooled_forward: one program per (BLOCK_B bags, D-block) reading rows[loc_u[inverse[i]]] in
    place (or the host row for a host location). `bag_out` [B] int64 / `count_out` [n_bags] (acc dtype) record
    each lookup's bag / each bag's non-padding lookups (>= 1) for the backward, where given."""
    n_bags, dim = offsets.numel() - 1, rows.shape[1]
    rows = rows.contiguous()
    out = torch.empty(n_bags, dim, dtype=rows.dtype, device=rows.device)
    max_pos = torch.empty(n_bags, dim, dtype=torch.int64, device=rows.device) if mode == MODE_MAX else None
    if n_bags == 0:
        return out, max_pos
    has_psw = per_sample_weights is not None and mode == MODE_SUM
    psw = per_sample_weights.contiguous() if has_psw else inverse
    host = host_rows if host_rows is not None else rows
    if host.dtype != rows.dtype or not host.is_contiguous():
        raise ValueError(f"host rows must be a contiguous {rows.dtype} table, got {host.dtype}")
    block_d = _forward_block_d(dim)
    block_b = min(forward_bags_per_program(block_d, rows.device), max(1, triton.next_power_of_2(n_bags)))
    grid = (triton.cdiv(n_bags, block_b), triton.cdiv(dim, block_d))
    with on_device(rows):
        pooled_forward_kernel[grid](
            rows, host, loc_u.contiguous(), inverse.contiguous(), offsets.contiguous(), psw, out,
            max_pos if max_pos is not None else out, bag_out if bag_out is not None else inverse,
            count_out if count_out is not None else out, n_bags, dim,
            BLOCK_B=block_b, BLOCK_D=block_d, MODE=mode, HAS_PSW=has_psw, SOFT_RTNE=soft_rtne(rows.device),
            ACC=tl_acc_dtype(rows.dtype), STORE_BAG=bag_out is not None, STORE_COUNT=count_out is not None,
            num_warps=max(1, min(4, block_b * block_d // 128)),
        )
    return out, max_pos


def pooled_forward(rows, loc_u, inverse, offsets, mode: int, per_sample_weights=None, host_rows=None, bag_out=None,
                   count_out=None, spare=None):
    """(out, max_pos); `bag_out` / `count_out` (optional): see pooled_forward_triton (the reference fills them with
    torch ops)."""
    if backend_for(rows.device) == "triton":
        return pooled_forward_triton(rows, loc_u, inverse, offsets, mode, per_sample_weights, host_rows, bag_out,
                                     count_out)
    if bag_out is not None or count_out is not None:
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                      output_size=inverse.numel())
        if bag_out is not None:
            bag_out.copy_(bag)
        if count_out is not None:
            count = torch.zeros(lengths.numel(), dtype=count_out.dtype, device=offsets.device)
            count_out.copy_(count.index_add_(0, bag, (inverse >= 0).to(count.dtype)).clamp(min=1))
    return pooled_forward_torch(rows, loc_u, inverse, offsets, mode, per_sample_weights, host_rows, spare)
