"""materialize(model): a model built on the meta device, allocated and initialized in one process.

The order is the model's module order, each module drawing its parameters from the CPU generator in turn:
cached tables by their `to_empty()` + `reset_parameters()`, every other module holding meta parameters by
`to_empty(recurse=False)` + its `reset_parameters()` (as torchrec's DistributedModelParallel initializes meta
modules). `cachedemb.distributed.shard` walks the same order, so a seeded job built on meta starts from the
same values at any world size as this one-process model.
"""
from __future__ import annotations

import torch
from torch import nn

from cachedemb.cache.exact_device import exact_device
from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection
from cachedemb.modules.embedding_bag import CachedEmbeddingBag


def is_under(name: str, prefixes) -> bool:
    """Whether module / state key `name` is one of `prefixes` or inside one ("" holds everything)."""
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


def meta_walk(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(path, module, is a cached table module) for every module to materialize, in module order: cached
    modules on meta, and other modules holding meta parameters or buffers themselves (not inside a cached
    module). Refuses up front a meta module without `reset_parameters()` (nothing is changed then)."""
    cached_types = (CachedEmbeddingBag, CachedEmbeddingBagCollection)
    out, cached_paths = [], []
    for name, module in model.named_modules():
        if is_under(name, cached_paths):
            continue
        if isinstance(module, cached_types):
            cached_paths.append(name)
            if _is_meta_cached(module):
                out.append((name, module, True))
            continue
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if any(t.is_meta for t in own):
            if not callable(getattr(module, "reset_parameters", None)):
                raise TypeError(f"module {name or '<root>'!r} ({type(module).__name__}) has parameters on the "
                                "meta device and no reset_parameters() to initialize them: build it on a real "
                                "device, or give it reset_parameters()")
            out.append((name, module, False))
    return out


def _is_meta_cached(module: nn.Module) -> bool:
    if hasattr(module, "is_meta"):
        return module.is_meta
    return module.device.type == "meta"  # a collection: no tables allocated yet


def materialize_dense(module: nn.Module, device: torch.device) -> None:
    """A non-cached module's own meta parameters and buffers allocated on `device` and reset."""
    module.to_empty(device=device, recurse=False)
    module.reset_parameters()


def materialize(model: nn.Module, device=None) -> nn.Module:
    """Allocate and initialize every meta part of `model` in one process (caches on `device`: default CUDA
    when there is one, else CPU; host tables in host memory), in module order. Returns `model`."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = exact_device(device)
    if device.type == "meta":
        raise ValueError("materialize(model, device): device must be a real device (cpu, cuda), got meta")
    for _, module, cached in meta_walk(model):
        if cached:
            module.to_empty(device=device)
            module.reset_parameters()
        else:
            materialize_dense(module, device)
    return model


__all__ = ["materialize", "materialize_dense", "meta_walk"]
