"""Fused sparse optimizers for CachedEmbeddingBag.

A spec says how a touched row and its per-row state change; the cache keeps that state beside the row in host
memory and moves it with the row on admit/evict, so training through any cache size equals full-table
training. Updates run inside backward (as FBGEMM's TBE does): one step per backward call.
"""
from __future__ import annotations

from dataclasses import dataclass

from cachedemb.kernels import ADAGRAD, ADAM, ROWWISE_ADAGRAD, SGD as _SGD, UpdateRule, adam_step_size


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, (int, float)) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")


@dataclass(frozen=True)
class SparseOptimizer:
    """Base: per-row state layout and the rule for a given 1-based step."""

    lr: float

    def __post_init__(self):
        _check_positive("lr", self.lr, allow_zero=True)

    def state_layout(self, dim: int) -> dict[str, tuple[int, float]]:
        """State name -> (columns per row, initial value)."""
        return {}

    def rule(self, step: int) -> UpdateRule:
        raise NotImplementedError


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """Plain SGD, as torch.optim.SGD on a sparse gradient (no momentum, no weight decay)."""

    lr: float = 0.01

    def rule(self, step: int) -> UpdateRule:
        return UpdateRule(_SGD, lr=float(self.lr))


@dataclass(frozen=True)
class _AccumulatorOptimizer(SparseOptimizer):
    """Adagrad-style rules: a running sum of squared gradients per element or per row."""

    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        _check_positive("eps", self.eps, allow_zero=True)
        _check_positive("initial_accumulator_value", self.initial_accumulator_value, allow_zero=True)


@dataclass(frozen=True)
class Adagrad(_AccumulatorOptimizer):
    """Element-wise Adagrad, as torch.optim.Adagrad on a sparse gradient (lr_decay=0)."""

    def state_layout(self, dim: int):
        return {"sum": (dim, float(self.initial_accumulator_value))}

    def rule(self, step: int) -> UpdateRule:
        return UpdateRule(ADAGRAD, lr=float(self.lr), eps=float(self.eps))


@dataclass(frozen=True)
class RowWiseAdagrad(_AccumulatorOptimizer):
    """FBGEMM's row-wise Adagrad: one accumulator per row (mean of g^2), 1/D of Adagrad's state."""

    eps: float = 1e-8

    def state_layout(self, dim: int):
        return {"sum": (1, float(self.initial_accumulator_value))}

    def rule(self, step: int) -> UpdateRule:
        return UpdateRule(ROWWISE_ADAGRAD, lr=float(self.lr), eps=float(self.eps))


@dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Lazy Adam, as torch.optim.SparseAdam: moments of untouched rows stay put; bias correction uses the
    global step (one per backward)."""

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        _check_positive("eps", self.eps, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")

    def state_layout(self, dim: int):
        return {"exp_avg": (dim, 0.0), "exp_avg_sq": (dim, 0.0)}

    def rule(self, step: int) -> UpdateRule:
        b1, b2 = (float(b) for b in self.betas)
        return UpdateRule(ADAM, lr=float(self.lr), eps=float(self.eps), beta1=b1, beta2=b2,
                          step_size=adam_step_size(float(self.lr), b1, b2, step))


__all__ = ["SparseOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam"]
