"""Fused sparse optimizer update of the touched cache rows, in place.

`rows [R, D]` and the optimizer's per-row `states` (each [R, D] or [R, 1], fp32) are indexed by `loc_u`; only
the first n_uniq entries of `loc_u` / `grad_u` are live. Every rule reproduces the torch sparse optimizer's
arithmetic order (SGD, Adagrad, SparseAdam) or FBGEMM's (row-wise Adagrad), so cached training equals
full-table training. `backward_update` is the fused entry point: on Triton one kernel reduces the lookups of
each unique id and applies the rule; the reference composes bag_backward and sparse_update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bag_backward import bag_backward_torch
from .dispatch import backend_for

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


def sparse_update_torch(rows, states, loc_u, grad_u, n_uniq, rule: UpdateRule):
    """Reference: the torch optimizers' sparse code paths, written out on the gathered rows."""
    idx, n = _live(loc_u, n_uniq)
    if n == 0:
        return
    g = grad_u[:n].float()
    w = rows.index_select(0, idx).float()
    if rule.kind == SGD:
        w.add_(g, alpha=-rule.lr)
    elif rule.kind == ADAGRAD:
        (acc,) = states
        s = acc.index_select(0, idx)
        s.add_(g.pow(2))
        std = s.sqrt().add_(rule.eps)
        w.add_(g / std, alpha=-rule.lr)
        acc.index_copy_(0, idx, s)
    elif rule.kind == ROWWISE_ADAGRAD:
        (acc,) = states
        s = acc.index_select(0, idx)
        s.add_(g.pow(2).mean(1, keepdim=True))
        w.addcdiv_(g, s.sqrt().add_(rule.eps), value=-rule.lr)
        acc.index_copy_(0, idx, s)
    else:
        exp_avg, exp_avg_sq = states
        m_old = exp_avg.index_select(0, idx)
        v_old = exp_avg_sq.index_select(0, idx)
        m_upd = g.sub(m_old).mul_(1 - rule.beta1)
        v_upd = g.pow(2).sub_(v_old).mul_(1 - rule.beta2)
        exp_avg.index_copy_(0, idx, m_old + m_upd)
        exp_avg_sq.index_copy_(0, idx, v_old + v_upd)
        numer = m_upd.add_(m_old)
        denom = v_upd.add_(v_old).sqrt_().add_(rule.eps)
        w.add_(numer.div_(denom).mul_(-rule.step_size))
    rows.index_copy_(0, idx, w.to(rows.dtype))


def sparse_update(rows, states, loc_u, grad_u, n_uniq, rule: UpdateRule):
    if backend_for(rows.device) == "triton":
        return sparse_update_triton(rows, states, loc_u, grad_u, n_uniq, rule)
    return sparse_update_torch(rows, states, loc_u, grad_u, n_uniq, rule)


def backward_update_torch(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode: int,
                          per_sample_weights, max_pos, rule: UpdateRule):
    """Reference of the fused op: segment reduction, then the update."""
    grad_u = bag_backward_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
    sparse_update_torch(rows, states, loc_u, grad_u, n_uniq, rule)


def backward_update(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode: int,
                    per_sample_weights, max_pos, rule: UpdateRule):
    if backend_for(rows.device) == "triton":
        return backward_update_triton(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode,
                                      per_sample_weights, max_pos, rule)
    return backward_update_torch(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, mode,
                                 per_sample_weights, max_pos, rule)


def adam_step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """torch.optim.SparseAdam's step size at (1-based) step t."""
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
