"""Fused sparse optimizer update of the touched cache rows, in place.

`rows [R, D]` and the optimizer's per-row `states` (each [R, D] or [R, 1], fp32, or fp64 with an fp64 table) are
indexed by `loc_u`; only the first n_uniq entries of `loc_u` / `grad_u` are live. The update math runs in
acc_dtype(rows.dtype): fp32, fp64 for an fp64 table. Every rule reproduces the torch sparse optimizer's
arithmetic order (SGD, Adagrad, SparseAdam) or FBGEMM's (row-wise Adagrad), so cached training equals
full-table training. `backward_update` is the fused entry point: on Triton one kernel reduces the lookups of
each unique id and applies the rule; the reference composes bag_backward and sparse_update. Its `grad_scale_u
[U]` (optional; 1 / count for `scale_grad_by_freq`) multiplies unique id j's summed gradient before the rule
(so Adagrad / Adam states see the scaled gradient).
"""

import importlib
import math
from dataclasses import dataclass

import torch
from .lazy_triton import tl, triton

from .bag_backward import (
    SCALE_BAG,
    SCALE_GIVEN,
    SCALE_ONE,
    SCALE_PSW,
    bag_of_lookup,
    backward_block_l,
    backward_chunk,
    backward_inputs,
    backward_launch,
    chunk_partials,
    lookup_scale,
    persistent_programs,
    unique_grad,
    unique_grad_torch,
)
from .dispatch import backend_for, on_device, soft_rtne
from .gather import put_rows
from .host_sgd import sgd_rows
from .pooled_forward import (
    HOST_LOC,
    MODE_MAX,
    MODE_MEAN,
    MODE_SUM,
    acc_dtype,
    cast_to,
    double_bits,
    host_loc,
    ieee_div,
    ieee_sqrt,
    scalar_of_bits,
    tl_acc_dtype,
)

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = "sgd", "adagrad", "rowwise_adagrad", "adam"
RULE_KINDS = (SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM)


@dataclass(frozen=True)
class UpdateRule:
    """One step's hyper-parameters, resolved on the host (Adam's bias correction folded into step_size)."""

    kind: str
    lr: float
    eps: float = 0.0
    beta1: float = 0.0
    beta2: float = 0.0
    step_size: float = 0.0  # adam: lr * sqrt(1 - beta2^t) / (1 - beta1^t)

    def __post_init__(self):
        if self.kind not in RULE_KINDS:
            raise ValueError(f"unknown update rule {self.kind!r}: expected one of {RULE_KINDS}")

    @property
    def num_states(self) -> int:
        return {SGD: 0, ADAGRAD: 1, ROWWISE_ADAGRAD: 1, ADAM: 2}[self.kind]


def _live(loc_u, n_uniq):
    n = int(n_uniq)
    return loc_u[:n], n


def sparse_update_torch(rows, states, loc_u, grad_u, n_uniq, rule: UpdateRule, host_rows=None, host_states=None):
    """Reference: the torch optimizers' sparse code paths, written out on the gathered rows. Rows at host
    locations (loc <= -2) are updated in the host table and host states."""
    idx, n = _live(loc_u, n_uniq)
    if n == 0:
        return
    _update_live(rows, states, idx, grad_u[:n], rule, host_rows, host_states)


def _update_live(rows, states, idx, g, rule: UpdateRule, host_rows=None, host_states=None):
    """sparse_update_torch on live locations `idx` and their gradients `g`."""
    on_host = idx <= HOST_LOC
    if host_rows is None or not bool(on_host.any()):
        _update_rows(rows, states, idx, g, rule)
        return
    _update_rows(rows, states, idx[~on_host], g[~on_host], rule)
    host_idx = host_loc(idx[on_host]).to(host_rows.device)
    _update_rows(host_rows, list(host_states), host_idx, g[on_host].to(host_rows.device), rule)


def _update_rows(rows, states, idx, g, rule: UpdateRule):
    if idx.numel() == 0:
        return
    acc = acc_dtype(rows.dtype)
    g = g.to(acc)
    if rule.kind == SGD and acc == rows.dtype and sgd_rows(rows, idx, g, -rule.lr):
        return
    w = rows.index_select(0, idx).to(acc)
    if rule.kind == SGD:
        w.add_(g, alpha=-rule.lr)
    elif rule.kind == ADAGRAD:
        (st,) = states
        s = st.index_select(0, idx).to(acc)
        s.add_(g.pow(2))
        std = s.sqrt().add_(rule.eps)
        w.add_(g / std, alpha=-rule.lr)
        put_rows(st, idx, s.to(st.dtype))
    elif rule.kind == ROWWISE_ADAGRAD:
        (st,) = states
        s = st.index_select(0, idx).to(acc)
        s.add_(g.pow(2).mean(1, keepdim=True))
        w.addcdiv_(g, s.sqrt().add_(rule.eps), value=-rule.lr)
        put_rows(st, idx, s.to(st.dtype))
    else:
        exp_avg, exp_avg_sq = states
        m_old = exp_avg.index_select(0, idx).to(acc)
        v_old = exp_avg_sq.index_select(0, idx).to(acc)
        m_upd = g.sub(m_old).mul_(1 - rule.beta1)
        v_upd = g.pow(2).sub_(v_old).mul_(1 - rule.beta2)
        put_rows(exp_avg, idx, (m_old + m_upd).to(exp_avg.dtype))
        put_rows(exp_avg_sq, idx, (v_old + v_upd).to(exp_avg_sq.dtype))
        numer = m_upd.add_(m_old)
        denom = v_upd.add_(v_old).sqrt_().add_(rule.eps)
        w.add_(numer.div_(denom).mul_(-rule.step_size))
    put_rows(rows, idx, w.to(rows.dtype))


RULE_IDS = {SGD: 0, ADAGRAD: 1, ROWWISE_ADAGRAD: 2, ADAM: 3}


@triton.jit
def rule_scalars(neg_lr, eps, c1, c2, neg_step, neg_lr_64, eps_64, c1_64, c2_64, neg_step_64, ACC: tl.constexpr):
    """The rule's scalars in ACC: the fp32 arguments as they are (read in place, no register held: converting
    int64 bits to fp32 up front made row-wise Adagrad spill on sm_80), or the fp64 ones from their bits."""
    if ACC == tl.float64:
        return (scalar_of_bits(neg_lr_64, ACC), scalar_of_bits(eps_64, ACC), scalar_of_bits(c1_64, ACC),
                scalar_of_bits(c2_64, ACC), scalar_of_bits(neg_step_64, ACC))
    else:
        return neg_lr, eps, c1, c2, neg_step


@triton.jit
def apply_rule(rows, s0, s1, i_r, o_d, m_d, D, b_g, b_den, neg_lr, eps, c1, c2, neg_step,
               RULE: tl.constexpr, SOFT_RTNE: tl.constexpr, ACC: tl.constexpr):
    """Update columns o_d of row i_r (and its state) with the ACC gradient b_g, in the reference's order and in
    ACC (states are read into ACC and stored back in their own dtype). b_den: row-wise Adagrad's
    sqrt(state) + eps for the row (unused by the other rules); the scalars are ACC values (rule_scalars)."""
    p_w = rows + i_r * D + o_d
    b_w = tl.load(p_w, mask=m_d, other=0.0).to(ACC)
    if RULE == 0:
        b_w = b_w + neg_lr * b_g
    elif RULE == 1:
        p_s = s0 + i_r * D + o_d
        b_s = tl.load(p_s, mask=m_d, other=0.0).to(ACC) + b_g * b_g
        tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_d)
        b_w = b_w + neg_lr * ieee_div(b_g, ieee_sqrt(b_s) + eps)
    elif RULE == 2:
        # addcdiv on CPU: w + (value * g) / denom
        b_w = b_w + ieee_div(neg_lr * b_g, b_den)
    else:
        p_m, p_v = s0 + i_r * D + o_d, s1 + i_r * D + o_d
        b_m = tl.load(p_m, mask=m_d, other=0.0).to(ACC)
        b_v = tl.load(p_v, mask=m_d, other=0.0).to(ACC)
        b_mu = (b_g - b_m) * c1
        b_vu = (b_g * b_g - b_v) * c2
        tl.store(p_m, (b_m + b_mu).to(p_m.dtype.element_ty), mask=m_d)
        tl.store(p_v, (b_v + b_vu).to(p_v.dtype.element_ty), mask=m_d)
        b_w = b_w + ieee_div(b_mu + b_m, ieee_sqrt(b_vu + b_v) + eps) * neg_step
    tl.store(p_w, cast_to(b_w, p_w.dtype.element_ty, SOFT_RTNE), mask=m_d)


@triton.jit
def rowwise_denominator(s0, i_r, b_old, b_sq, D, eps, ACC: tl.constexpr):
    """Row-wise Adagrad: state (b_old, read by the caller before reducing g) += mean(g^2) over the row; returns
    sqrt(state) + eps. Every thread reads the scalar state and all must read it before any writes it: the
    callers load it before the gradient's cross-warp reductions, whose barriers order every warp's read before
    this write. (Read here, a warp that ran late read the new state, added mean(g^2) twice and updated its
    columns with a wrong denominator: seen on an H100 as rare, run-to-run varying rows.)"""
    b_s = b_old.to(ACC) + ieee_div(b_sq, tl.full([], D, dtype=ACC))
    tl.store(s0 + i_r, b_s.to(s0.dtype.element_ty))
    return ieee_sqrt(b_s) + eps


# The rule's scalars travel twice: as fp32 arguments (used by fp32 updates, exactly as before fp64 tables) and as
# the int64 bits of their doubles (double_bits; used by fp64 updates: Triton passes a Python float as fp32).
# Neither is specialized on its value.
SCALAR_ARGS = ["neg_lr", "eps", "c1", "c2", "neg_step", "neg_lr_64", "eps_64", "c1_64", "c2_64", "neg_step_64"]


@triton.jit(do_not_specialize=SCALAR_ARGS)
def sparse_update_kernel(
    rows,  # [R, D] updated in place
    s0,  # first state ([R, D] or [R, 1] fp32 / fp64), or a dummy
    s1,  # second state (Adam), or a dummy
    loc_u,  # [U] int64 row of each unique id
    grad_u,  # [U, D] fp32 / fp64
    n_uniq,  # [1] int64 live entries of loc_u / grad_u
    D,
    neg_lr, eps, c1, c2, neg_step,  # fp32
    neg_lr_64: tl.int64, eps_64: tl.int64, c1_64: tl.int64, c2_64: tl.int64, neg_step_64: tl.int64,
    RULE: tl.constexpr,
    SOFT_RTNE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,  # update math: fp32, fp64 for an fp64 table
):
    # persistent programs over the live unique ids, up to the count read on the device
    neg_lr, eps, c1, c2, neg_step = rule_scalars(neg_lr, eps, c1, c2, neg_step, neg_lr_64, eps_64, c1_64, c2_64,
                                                 neg_step_64, ACC)
    i_u = tl.program_id(0).to(tl.int64)
    while i_u < tl.load(n_uniq):  # re-read per round: a bound held across the body spilled (sm_80/sm_90)
        i_r = tl.load(loc_u + i_u).to(tl.int64)
        b_den = 0.0
        if RULE == 2:
            b_old = tl.load(s0 + i_r)
            b_sq = tl.full([], 0.0, dtype=ACC)
            for i_d in range(0, tl.cdiv(D, BLOCK_D)):
                o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
                b_g = tl.load(grad_u + i_u * D + o_d, mask=o_d < D, other=0.0).to(ACC)
                b_sq += tl.sum(b_g * b_g)
            b_den = rowwise_denominator(s0, i_r, b_old, b_sq, D, eps, ACC)
        for i_d in range(0, tl.cdiv(D, BLOCK_D)):
            o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
            m_d = o_d < D
            b_g = tl.load(grad_u + i_u * D + o_d, mask=m_d, other=0.0).to(ACC)
            apply_rule(rows, s0, s1, i_r, o_d, m_d, D, b_g, b_den, neg_lr, eps, c1, c2, neg_step, RULE, SOFT_RTNE,
                       ACC)
        i_u += tl.num_programs(0)


@triton.jit(do_not_specialize=SCALAR_ARGS)
def backward_update_kernel(
    rows,  # [R, D] updated in place
    s0,  # first state ([R, D] or [R, 1] fp32 / fp64), or a dummy
    s1,  # second state (Adam), or a dummy
    host_rows,  # [N, D] host table: rows at host locations (loc <= -2) are updated there, in place
    h0,  # host first state (or the same dummy kind as s0)
    h1,  # host second state
    loc_u,  # [B] int64 row of each unique id
    n_uniq,  # [1] int64
    grad_out,  # [n_bags, D]
    perm,  # [B] int64 lookups sorted by unique position
    ptr,  # [B + 1] int64 group starts
    cptr,  # [B + 1] int64 chunk starts of each group (CHUNKED only)
    partial,  # [K, D] GACC partial sums of the chunks of long groups (CHUNKED only)
    bag,  # [B] int64 bag of each lookup
    scale,  # [B] GACC (sum / mean)
    max_pos,  # [n_bags, D] int64 (max)
    gscale,  # [U] factor on each unique id's summed gradient (HAS_GSCALE only)
    dirty,  # [R] bool (as uint8): cache rows updated are marked dirty (MARK_DIRTY only)
    D,
    lead,  # grad_out row of bag b: b - lead (phantom bags of unvalidated offsets come first)
    neg_lr, eps, c1, c2, neg_step,  # fp32
    neg_lr_64: tl.int64, eps_64: tl.int64, c1_64: tl.int64, c2_64: tl.int64, neg_step_64: tl.int64,
    MODE: tl.constexpr,
    RULE: tl.constexpr,
    SOFT_RTNE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GACC: tl.constexpr,  # gradient reduction: acc_dtype(grad_out.dtype)
    ACC: tl.constexpr,  # update math: acc_dtype(rows.dtype)
    HAS_GSCALE: tl.constexpr,
    CHUNKED: tl.constexpr,  # long groups were reduced into `partial` first (chunk_partials)
    SCALE: tl.constexpr,  # how `scale` weighs a lookup (bag_backward.SCALE_*)
    MARK_DIRTY: tl.constexpr,
):
    # persistent programs over the live unique ids, up to the count read on the device
    neg_lr, eps, c1, c2, neg_step = rule_scalars(neg_lr, eps, c1, c2, neg_step, neg_lr_64, eps_64, c1_64, c2_64,
                                                 neg_step_64, ACC)
    i_u = tl.program_id(0).to(tl.int64)
    while i_u < tl.load(n_uniq):  # re-read per round: a bound held across the body spilled (sm_80/sm_90)
        i_r = tl.load(loc_u + i_u).to(tl.int64)
        on_cache = i_r >= 0
        p_rows, p_s0, p_s1 = rows, s0, s1
        if i_r <= -2:
            p_rows, p_s0, p_s1 = host_rows, h0, h1
            i_r = -2 - i_r
        b_gs = 1.0
        if HAS_GSCALE:  # read once up front: read per D-block (after each reduction), max-mode Adam spilled
            b_gs = tl.load(gscale + i_u).to(GACC)
        b_den = 0.0
        if RULE == 2:
            b_old = tl.load(p_s0 + i_r)
            # the row's mean of g^2 comes first: reduce every D-block once (summed across blocks element-wise,
            # then across the lanes), then again to update
            b_sq = tl.zeros([BLOCK_D], dtype=ACC)
            for i_d in range(0, tl.cdiv(D, BLOCK_D)):
                o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
                b_g = unique_grad(grad_out, perm, ptr, cptr, partial, bag, scale, max_pos, i_u, o_d, o_d < D, D,
                                  lead, MODE, BLOCK_L, BLOCK_D, GACC, CHUNKED, SCALE)
                if HAS_GSCALE:
                    b_g = b_g * b_gs
                b_g = b_g.to(ACC)
                b_sq += b_g * b_g
            b_den = rowwise_denominator(p_s0, i_r, b_old, tl.sum(b_sq), D, eps, ACC)
        for i_d in range(0, tl.cdiv(D, BLOCK_D)):
            o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
            m_d = o_d < D
            b_g = unique_grad(grad_out, perm, ptr, cptr, partial, bag, scale, max_pos, i_u, o_d, m_d, D, lead, MODE,
                              BLOCK_L, BLOCK_D, GACC, CHUNKED, SCALE)
            if HAS_GSCALE:
                b_g = b_g * b_gs
            apply_rule(p_rows, p_s0, p_s1, i_r, o_d, m_d, D, b_g.to(ACC), b_den, neg_lr, eps, c1, c2, neg_step,
                       RULE, SOFT_RTNE, ACC)
        if MARK_DIRTY:
            if on_cache:
                tl.store(dirty + i_r, 1)
        i_u += tl.num_programs(0)


def _rule_args(rows, states, rule: UpdateRule):
    if len(states) != rule.num_states:
        raise ValueError(f"{rule.kind} needs {rule.num_states} state tensor(s), got {len(states)}")
    allowed = {torch.float32, acc_dtype(rows.dtype)}
    for st in states:
        if st.dtype not in allowed or not st.is_contiguous() or st.shape[0] != rows.shape[0]:
            names = " or ".join(sorted(str(d).removeprefix("torch.") for d in allowed))
            raise ValueError(f"optimizer states must be contiguous {names} [{rows.shape[0]}, D or 1], "
                             f"got {st.dtype} {tuple(st.shape)}")
    if not rows.is_contiguous():
        raise ValueError("rows must be contiguous (updated in place)")
    s0 = states[0] if len(states) > 0 else rows
    s1 = states[1] if len(states) > 1 else s0
    return s0, s1


def _scalars(rule: UpdateRule):
    """The kernels' scalar arguments (SCALAR_ARGS): as floats, then as the bits of their doubles."""
    values = (-rule.lr, rule.eps, 1 - rule.beta1, 1 - rule.beta2, -rule.step_size)
    return values + tuple(double_bits(x) for x in values)


def _update_block_d(dim: int, block_l: int = 1) -> int:
    """Columns per pass; with [block_l, D] gradient tiles (GPU) 64, which keeps row-wise Adagrad free of
    stack use on sm_80."""
    return min(triton.next_power_of_2(dim), 128 if block_l == 1 else 64)


def sparse_update_triton(rows, states, loc_u, grad_u, n_uniq, rule: UpdateRule):
    """Triton path of sparse_update: persistent programs (grid sized by the machine) loop over the unique
    positions up to n_uniq, read on the device."""
    capacity, dim = loc_u.numel(), rows.shape[1]
    if capacity == 0:
        return
    s0, s1 = _rule_args(rows, states, rule)
    block_d = _update_block_d(dim)
    with on_device(rows):
        sparse_update_kernel[(persistent_programs(rows.device, capacity),)](
            rows, s0, s1, loc_u.contiguous(), grad_u.contiguous(), n_uniq.reshape(1), dim, *_scalars(rule),
            RULE=RULE_IDS[rule.kind], SOFT_RTNE=soft_rtne(rows.device), BLOCK_D=block_d,
            ACC=tl_acc_dtype(rows.dtype), num_warps=max(1, min(4, block_d // 128)),
        )


def _backward_update_triton(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode, per_sample_weights,
                            max_pos, rule, block_l=None, host_rows=None, host_states=None, grad_scale_u=None,
                            groups=None, chunk="auto", bag=None, bag_count=None, grad_lead=0, dirty=None):
    capacity, dim = inverse.numel(), rows.shape[1]
    if capacity == 0:
        return
    s0, s1 = _rule_args(rows, states, rule)
    if host_rows is None:
        h_rows, h0, h1 = rows, s0, s1  # no host locations: never read
    else:
        h_rows = host_rows
        h0, h1 = _rule_args(host_rows, list(host_states), rule)
    grad_out = grad_out.contiguous()
    if bag is not None and groups is not None and (mode != MODE_MEAN or bag_count is not None):
        # the forward recorded each lookup's bag (and, for mean, each bag's size): no [B] temporaries here
        (perm, ptr), max_pos = groups, (max_pos if mode == MODE_MAX else grad_out)
        if mode == MODE_MEAN:
            scale, scale_kind = bag_count, SCALE_BAG
        elif mode == MODE_SUM and per_sample_weights is not None:
            scale, scale_kind = per_sample_weights, SCALE_PSW
        else:
            scale, scale_kind = inverse, SCALE_ONE
    else:
        perm, ptr, bag, scale, max_pos = backward_inputs(grad_out, inverse, offsets, mode, per_sample_weights,
                                                         max_pos, groups)
        scale_kind = SCALE_GIVEN
    max_pos = max_pos.contiguous()
    has_gscale = grad_scale_u is not None
    block_l = block_l or backward_block_l(rows.device)
    block_d = _update_block_d(dim, block_l)
    chunk = backward_chunk(rows.device) if chunk == "auto" else chunk
    split = chunk_partials(grad_out, perm, ptr, bag, scale, max_pos, mode, chunk, block_l, block_d, grad_lead,
                           scale_kind)
    cptr, partial = split if split is not None else (ptr, grad_out)
    with on_device(rows):
        backward_update_kernel[(persistent_programs(rows.device, capacity),)](
            rows, s0, s1, h_rows, h0, h1, loc_u.contiguous(), n_uniq.reshape(1), grad_out, perm, ptr, cptr,
            partial, bag, scale, max_pos, grad_scale_u.contiguous() if has_gscale else scale,
            dirty.view(torch.uint8) if dirty is not None else loc_u, dim, grad_lead,
            *_scalars(rule), MODE=mode, RULE=RULE_IDS[rule.kind], SOFT_RTNE=soft_rtne(rows.device),
            BLOCK_L=block_l, BLOCK_D=block_d, GACC=tl_acc_dtype(grad_out.dtype), ACC=tl_acc_dtype(rows.dtype),
            HAS_GSCALE=has_gscale, CHUNKED=split is not None, SCALE=scale_kind, MARK_DIRTY=dirty is not None,
            **backward_launch(block_l, block_d, torch.float64 in (rows.dtype, grad_out.dtype)),
        )


def backward_update_triton(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode: int,
                           per_sample_weights, max_pos, rule: UpdateRule, host_rows=None, host_states=None,
                           grad_scale_u=None, groups=None, bag=None, bag_count=None, grad_lead=0, grad_trail=0,
                           dirty=None):
    """Fused Triton path: persistent programs (a grid sized by the machine) loop over the unique ids up to
    n_uniq, read on the device; each sums the gradient of its lookups (grouped by a stable sort, or `groups` =
    (perm, ptr) from unique_ids' sort; no atomics; a hot id's long group is reduced in chunks by a first kernel,
    see bag_backward.segment_partials_kernel), scales it by grad_scale_u[j] when given, and applies the rule to
    its row in place: a cache row, or a host row (pinned, through UVA) for a host location. `bag` / `bag_count`
    (each lookup's bag, each bag's size: pooled_forward records them) spare the [B] temporaries; `grad_lead` /
    `grad_trail`: grad_out lacks that many phantom bags at either end (their lookups are all padding); `dirty`
    ([R] bool): the cache rows updated are marked there."""
    _backward_update_triton(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode, per_sample_weights,
                            max_pos, rule, host_rows=host_rows, host_states=host_states, grad_scale_u=grad_scale_u,
                            groups=groups, bag=bag, bag_count=bag_count, grad_lead=grad_lead, dirty=dirty)


def sparse_update(rows, states, loc_u, grad_u, n_uniq, rule: UpdateRule):
    """Update cache rows (no host locations) with per-unique gradients."""
    if backend_for(rows.device) == "triton":
        return sparse_update_triton(rows, states, loc_u, grad_u, n_uniq, rule)
    return sparse_update_torch(rows, states, loc_u, grad_u, n_uniq, rule)


def backward_update_torch(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode: int,
                          per_sample_weights, max_pos, rule: UpdateRule, host_rows=None, host_states=None,
                          grad_scale_u=None, groups=None, bag=None, bag_count=None, grad_lead=0, grad_trail=0,
                          dirty=None):
    """Reference of the fused op: segment reduction (of the live unique ids only, scaled by grad_scale_u), then
    the update; grouped by `groups` (perm, ptr) from unique_ids' sort when given, else sorted here. On CPU
    (sum / mean) both run in passes over blocks of unique ids (`_backward_update_cpu`), with the same values.
    `bag` / `bag_count` are not needed here; phantom bags (`grad_lead` / `grad_trail`) get zero gradients and the
    updated cache rows are marked in `dirty` where given."""
    if grad_lead or grad_trail:
        dim = grad_out.shape[1]
        grad_out = torch.cat([grad_out.new_zeros(grad_lead, dim), grad_out, grad_out.new_zeros(grad_trail, dim)])
    _backward_update_ref(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode, per_sample_weights, max_pos,
                         rule, host_rows, host_states, grad_scale_u, groups)
    if dirty is not None:
        live = (torch.arange(loc_u.numel(), device=loc_u.device) < n_uniq) & (loc_u >= 0)
        dirty.index_fill_(0, torch.where(live, loc_u, torch.full_like(loc_u, dirty.numel() - 1)), True)
        dirty[-1] = False


def _backward_update_ref(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode, per_sample_weights, max_pos,
                         rule, host_rows, host_states, grad_scale_u, groups):
    if mode != MODE_MAX and rows.device.type == "cpu" and grad_out.device.type == "cpu":
        if _backward_update_cpu(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode, per_sample_weights,
                                rule, host_rows, host_states, grad_scale_u, groups):
            return
    grad_u = unique_grad_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, grad_scale_u,
                               groups)
    sparse_update_torch(rows, states, loc_u, grad_u, n_uniq, rule, host_rows, host_states)


# Bytes of one pass's [ids, D] gradient block on CPU (_backward_update_cpu): small enough that the block and the
# rows it updates stay in cache, and that the allocator hands back the same blocks each pass (whole-batch
# temporaries were fresh, page-faulting memory every step).
CPU_PASS_BYTES = 1 << 19
_BAG_BACKWARD = importlib.import_module(".bag_backward", __package__)  # the module (the package exports the op)


def _backward_update_cpu(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode, per_sample_weights, rule,
                         host_rows, host_states, grad_scale_u, groups) -> bool:
    """unique_grad_torch + sparse_update_torch in passes over blocks of unique ids: each pass reduces its ids'
    lookups with one torch.embedding_bag over their slice of the grouped lookups (the whole-batch call's bags,
    cut at bag boundaries: the same per-bag sums) and updates their rows (row-wise rules: the same values).
    Counts are read on the host (CPU only). Returns False, doing nothing, where the two counts disagree (left to
    the unsplit reference)."""
    # the module's lookup_groups, looked up at call time (as unique_grad_torch does: tests count its calls)
    perm, ptr = groups if groups is not None else _BAG_BACKWARD.lookup_groups(inverse)
    n_groups = int((ptr[1:] > ptr[:-1]).sum())
    n = int(n_uniq)
    if n > n_groups:
        return False
    if n == 0:
        return True
    n_lookups = inverse.numel()
    acc = acc_dtype(grad_out.dtype)
    bag = bag_of_lookup(offsets, n_lookups).index_select(0, perm)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights, acc).index_select(0, perm)
    weight = grad_out.to(acc).contiguous()
    step = max(1, CPU_PASS_BYTES // max(1, grad_out.shape[1] * weight.element_size()))
    starts = list(range(0, n, step))
    bounds = ptr.index_select(0, torch.tensor(starts + [n], device=ptr.device)).tolist()
    for k, a in enumerate(starts):
        b = min(a + step, n)
        # the pass's lookups; the whole-batch call's last bag (n_groups - 1) runs to the end (over the padding
        # lookups, scale 0, sorted last), so a pass ending there does too
        lo, hi = bounds[k], (n_lookups if b == n_groups else bounds[k + 1])
        grad_u, _, _, _ = torch.embedding_bag(weight, bag[lo:hi], ptr[a:b] - lo, False, MODE_SUM, False,
                                              scale[lo:hi], False, None)
        if grad_scale_u is not None:
            grad_u = grad_u * grad_scale_u[a:b].to(device=grad_u.device, dtype=grad_u.dtype).unsqueeze(1)
        _update_live(rows, states, loc_u[a:b], grad_u, rule, host_rows, host_states)
    return True


def backward_update(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode: int,
                    per_sample_weights, max_pos, rule: UpdateRule, host_rows=None, host_states=None,
                    grad_scale_u=None, groups=None, bag=None, bag_count=None, grad_lead=0, grad_trail=0, dirty=None):
    fn = backward_update_triton if backend_for(rows.device) == "triton" else backward_update_torch
    return fn(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode, per_sample_weights, max_pos, rule,
              host_rows, host_states, grad_scale_u, groups, bag=bag, bag_count=bag_count, grad_lead=grad_lead,
              grad_trail=grad_trail, dirty=dirty)


def adam_step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """torch.optim.SparseAdam's step size at (1-based) step t."""
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
