"""Device launches per training step, counted on any machine (the launch budget of docs/architecture.md).

A launch is a Triton kernel launch or a non-view aten op issued outside one (under the torch backend on CPU,
every op is one). Each costs 5-10 us of host time on a GPU whatever it does, so a step made of hundreds of small
ops spends more time launching than the whole all-in-GPU step computes. Counted with a `TorchDispatchMode`
(aten ops; the ops Triton's CPU interpreter issues while it runs a kernel are the kernel, not launches) and by
wrapping `JITFunction.run` / the interpreter's `InterpretedFunction.run` (kernel launches).

Every counted op is attributed to the innermost frame of the library that issued it:

- `launches`: issued by the library (cachedemb/, kernels/), forward, backward (called by autograd) and, with
  the prefetch pipeline, window admission (the cache operations it calls): the budget;
- `host_pipeline`: issued by cachedemb/prefetch/ outside the cache and the kernels: the read-ahead bookkeeping
  over the host copies of a DataLoader's ids (extracting them, unique ids, next uses, unions), host work when the
  cache is on a GPU, reported apart;
- `caller`: the training loop's own ops (`out.sum()`, autograd's gradient seed).

`measure_step` builds the budget's configuration (one table, fused Adagrad, sync-free sizing, Triton backend,
`validate_inputs=False`) and averages over steps in the steady state; with prefetch, window admission happens
once per `depth` batches, so the average is taken over whole windows.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = Path(__file__).resolve().parents[2]
_LIBRARY = (str(_ROOT / "cachedemb") + os.sep, str(_ROOT / "kernels") + os.sep)
_TOOLS = str(_ROOT / "cachedemb" / "tools") + os.sep
_HOST_PIPELINE = str(_ROOT / "cachedemb" / "prefetch") + os.sep


_DEVICE_LAYERS = (str(_ROOT / "cachedemb" / "cache") + os.sep, str(_ROOT / "kernels") + os.sep)


def _library_site(depth: int = 2) -> tuple[str, str] | None:
    """(bucket, 'file:function') of the innermost library frame that is not this tool, or None (the caller). An op
    the prefetch pipeline issues outside the cache and the kernels (its read-ahead over the batches' host ids,
    the modules' id extraction for it) is host work: bucket `host_pipeline`."""
    frame = sys._getframe(depth)
    site = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_LIBRARY) and not path.startswith(_TOOLS):
            if site is None:
                site = f"{Path(path).relative_to(_ROOT)}:{frame.f_code.co_name}"
                if path.startswith(_DEVICE_LAYERS):
                    return "launches", site
            if path.startswith(_HOST_PIPELINE):
                return "host_pipeline", site
        frame = frame.f_back
    return None if site is None else ("launches", site)


@dataclass
class LaunchCounts:
    """Counts of one counted region: totals per bucket, per op name, per issuing site."""

    launches: int = 0  # the library's device launches (the budget)
    triton: int = 0  # of which Triton kernel launches
    aten: int = 0  # of which aten ops
    host_pipeline: int = 0
    caller: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)  # library launches by op
    sites: collections.Counter = field(default_factory=collections.Counter)  # library launches by site

    def add(self, name: str, triton: bool, where: tuple[str, str] | None) -> None:
        if where is None:
            self.caller += 1
            return
        bucket, site = where
        if bucket == "host_pipeline":
            self.host_pipeline += 1
            return
        self.launches += 1
        self.triton += triton
        self.aten += not triton
        self.ops[name] += 1
        self.sites[site] += 1

    def per_step(self, steps: int) -> dict:
        """Averages per step, with the most frequent ops and sites (totals over the region)."""
        return {"launches": self.launches / steps, "triton": self.triton / steps, "aten": self.aten / steps,
                "host_pipeline_ops": self.host_pipeline / steps, "caller_ops": self.caller / steps,
                "steps": steps, "top_ops": dict(self.ops.most_common(25)),
                "top_sites": dict(self.sites.most_common(25))}


class _AtenCounter(TorchDispatchMode):
    def __init__(self, owner: "LaunchCounter"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        owner = self.owner
        if owner.active and owner.in_kernel == 0 and not func.is_view:
            owner.counts.add(f"aten.{func.__name__}", False, _library_site())
        return out


class LaunchCounter:
    """Context manager counting launches while `active` (set it around the region to count).

    >>> with LaunchCounter() as counter:
    ...     counter.active = True; step(); counter.active = False
    >>> counter.counts.launches
    """

    def __init__(self, execute: bool = True):
        self.counts = LaunchCounts()
        self.active = False
        self.in_kernel = 0
        # execute=False (Triton's CPU interpreter only): count the launches without running the kernels. Valid
        # where no host decision reads a device value (the sync-free mode): the launch sequence is then the same
        # whatever the kernels compute (measure_step checks it against a run that executes).
        self.execute = execute
        self._stack = contextlib.ExitStack()

    def reset(self) -> None:
        self.counts = LaunchCounts()

    def __enter__(self) -> "LaunchCounter":
        for cls in _kernel_classes():
            self._patch(cls)
        self._stack.enter_context(_AtenCounter(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _patch(self, cls) -> None:
        # Triton < 3.2's interpreter launches through GridExecutor.__call__ (InterpretedFunction.run is set per
        # instance there), later ones through the class's `run`.
        attr = "__call__" if cls.__name__ == "GridExecutor" else "run"
        real = getattr(cls, attr)
        interpreted = cls.__name__ in ("InterpretedFunction", "GridExecutor")
        counter = self

        def run(fn, *args, **kwargs):
            if counter.active and counter.in_kernel == 0:
                counter.counts.add(f"triton.{fn.fn.__name__}", True, _library_site())
            if not counter.execute and interpreted:
                return None
            counter.in_kernel += 1
            try:
                return real(fn, *args, **kwargs)
            finally:
                counter.in_kernel -= 1

        setattr(cls, attr, run)
        self._stack.callback(setattr, cls, attr, real)


def _kernel_classes() -> list:
    from triton.runtime.jit import JITFunction
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import GridExecutor, InterpretedFunction
        classes.append(InterpretedFunction if "run" in vars(InterpretedFunction) else GridExecutor)
    except ImportError:
        pass
    return classes


@contextlib.contextmanager
def _environment(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def zipf_batches(n: int, num_rows: int, bags: int, bag_len: int, seed: int = 0) -> list:
    """Batches of `bags` x `bag_len` ids, Zipf(1.05) with the hot ids scattered over the table."""
    from cachedemb.tools.traces import zipf_trace

    offsets = torch.arange(0, bags * bag_len, bag_len)
    return [(torch.from_numpy(t).to(torch.int64), offsets) for t in zipf_trace(num_rows, bags * bag_len, n, 1.05,
                                                                                seed=seed)]


def measure_step(bags: int = 64, bag_len: int = 26, num_rows: int = 200_000, cache_rows: int = 4000,
                 dim: int = 16, prefetch: tuple[int, int] | None = None, warmup: int = 6, steps: int = 4,
                 backend: str = "triton", sync_free: bool = True, optimizer=None, seed: int = 0,
                 execute: bool = True) -> dict:
    """Launches per steady-state training step (forward, `out.sum().backward()` with the fused optimizer).

    `prefetch=(depth, horizon)` runs the batches through `cachedemb.prefetch`: then `warmup` and `steps` are
    rounded up to whole windows, and every `next()` of the pipeline (window admission) is counted too.
    Needs TRITON_INTERPRET=1 (set before triton is imported) for the Triton backend on CPU. `execute=False`
    counts without running the Triton kernels (see LaunchCounter; the interpreter takes ~1 min a step at 64 x 26,
    mostly in the backward's per-id loop): sync-free only."""
    if not execute and not sync_free:
        raise ValueError("execute=False counts only the sync-free mode, whose launches do not depend on values")
    import cachedemb
    from cachedemb import optim

    if prefetch is not None:
        depth = prefetch[0]
        warmup, steps = -(-warmup // depth) * depth, -(-steps // depth) * depth
    env = {"CACHEDEMB_BACKEND": backend, "CACHEDEMB_SYNC_FREE": "1" if sync_free else "0"}
    with _environment(**env):
        torch.manual_seed(seed)
        emb = cachedemb.CachedEmbeddingBag(num_rows, dim, mode="sum", cache_rows=cache_rows,
                                           optimizer=optimizer or optim.Adagrad(lr=0.1), device="cpu",
                                           validate_inputs=False)
        # the pipeline reads horizon + 2 x depth batches ahead of the one yielded: enough batches that it still
        # reads one per counted step (the steady state)
        extra = prefetch[1] + 2 * prefetch[0] + 1 if prefetch is not None else 0
        batches = zipf_batches(warmup + steps + extra, num_rows, bags, bag_len, seed)
        source = (cachedemb.prefetch(batches, [emb], depth=prefetch[0], horizon=prefetch[1])
                  if prefetch is not None else batches)
        it = iter(source)
        with LaunchCounter(execute) as counter:
            for step in range(warmup + steps):
                counter.active = step >= warmup
                ids, offsets = next(it)
                emb(ids, offsets).sum().backward()
                counter.active = False
            if prefetch is not None:
                it.close()
    out = counter.counts.per_step(steps)
    out.update(bags=bags, bag_len=bag_len, num_rows=num_rows, cache_rows=cache_rows, dim=dim, backend=backend,
               sync_free=sync_free, executed=execute,
               prefetch=None if prefetch is None else {"depth": prefetch[0], "horizon": prefetch[1]})
    return out
