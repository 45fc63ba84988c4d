"""Learning-rate schedule shared by the dense optimizer and the fused embedding optimizer.

Shape (the DLRM reference's `LRPolicyScheduler`: facebookresearch/dlrm torchrec_dlrm/lr_scheduler.py, copied
there from the dlrm `mlperf` branch), for the update of 1-based step k: linear warm-up k / warmup_steps while
k < warmup_steps; then 1; from `decay_start` a quadratic decay ((decay_steps - (k - decay_start)) / decay_steps)^2
for decay_steps updates, then held at its last value; never below 1e-7 of the base (the reference's min_lr).
One deliberate difference: between warm-up and decay the reference holds the last warm-up value
((warmup_steps - 1) / warmup_steps) when a decay is set; here the rate is the full base rate, as without one.
`scale(step)` is a pure function of the step, so a resumed run gets the same learning rates.

Why warm-up matters for this recipe: Adagrad's first update is `lr * g / |g|` on every element, a step of
exactly `lr` on every weight whatever the gradient's size; across a 1024-wide MLP that moves the logit by
O(lr * width) and the second batch's loss jumps to 10^0 .. 10^6 (tests/recipes/test_recipe_model.py measures
it). A warm-up makes the first steps a fraction of `lr`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

MIN_SCALE = 1e-7  # the reference's floor during decay (min_lr = 1e-7 for its base lrs of O(1))


@dataclass(frozen=True)
class LRSchedule:
    warmup_steps: int = 0
    decay_start: int = 0
    decay_steps: int = 0

    def __post_init__(self):
        for name in ("warmup_steps", "decay_start", "decay_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LRSchedule: {name}={value!r}; expected an int >= 0")
        if self.decay_steps and self.decay_start < self.warmup_steps:
            raise ValueError(f"LRSchedule: decay_start={self.decay_start} < warmup_steps={self.warmup_steps}; "
                             "expected the warm-up to finish before the decay starts")

    def scale(self, step: int) -> float:
        """Multiplier of the base learning rate for the update of 1-based `step`."""
        if step < 1:
            raise ValueError(f"LRSchedule.scale: step={step!r}; expected a 1-based step >= 1")
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.decay_steps and step >= self.decay_start:
            t = min(step - self.decay_start, self.decay_steps - 1)
            return max(MIN_SCALE, ((self.decay_steps - t) / self.decay_steps) ** 2)
        return 1.0


def set_learning_rates(model, dense_opt: torch.optim.Optimizer, dense_lr: float, sparse_lr: float) -> None:
    """Set the dense optimizer's and every fused embedding optimizer's learning rate (before a step).

    The fused optimizers are frozen dataclasses read at each backward, so each group bag gets a copy with
    the new `lr` (its per-row state lives in the cache, untouched)."""
    for group in dense_opt.param_groups:
        group["lr"] = dense_lr
    for bag in model.sparse_arch.bags:
        if bag.optimizer is not None and bag.optimizer.lr != sparse_lr:
            bag.optimizer = dataclasses.replace(bag.optimizer, lr=sparse_lr)
