"""Graph capture of a CachedEmbeddingBagCollection, whose cache (admission, eviction, write-back to the host
table) is Python-side state that must stay one opaque step in any captured graph:

* `torch.fx.symbolic_trace`: `fx_lookup(collection, kjt)` is one node (the collection registers it with
  `torch.fx.wrap`); the collection is a get_attr of the traced model, so the GraphModule holds and runs it.
  Traced on its own (the root), the graph names the live collection by its handle (`fx_lookup_live`).
* `torch.export.export(..., strict=False)` (and strict export): the custom op `cachedemb::collection_lookup`
  takes the KeyedJaggedTensor's parts and the live collection's handle; its fake kernel gives the output
  shape. The exported program runs in the process holding the collection, for inference (no autograd).
* `torch.compile`: `eager_outside_dynamo` makes the lookup a graph break; autograd (the fused optimizer in
  backward) works as in eager mode.
* `torch.jit.script` / `torch.jit.trace`: refused (`NotScriptableError`), pointing at what works.
"""
from __future__ import annotations

import itertools
import weakref

import torch

from cachedemb.modules.errors import NotScriptableError  # noqa: F401  (re-exported: raised by the collection)

SCRIPT_MESSAGE = (
    "cannot compile CachedEmbeddingBagCollection: its device cache is Python-side state (admission, eviction, "
    "write-back to the host table) that TorchScript cannot express. For a TorchScript model, script "
    "`collection.to_embedding_bag_collection()` (a torchrec EmbeddingBagCollection holding a copy of the "
    "tables); to capture a graph with the cache in it, use torch.fx.symbolic_trace or "
    "torch.export.export(..., strict=False).")



def is_exporting() -> bool:
    flag = getattr(torch.compiler, "is_exporting", None)
    return bool(flag()) if flag is not None else False


def _eager_call(module, features, jagged: str):
    return module._eager_forward(features, jagged)


# torch._dynamo is imported on the first compiled call, not when cachedemb is imported.
eager_outside_dynamo = torch._disable_dynamo(_eager_call)


def fx_lookup(module, features) -> torch.Tensor:
    """The collection's lookup of a KeyedJaggedTensor -> float32 [B, sum(dims)]: one node of an fx graph."""
    return module._eager_forward(features).values()


def fx_lookup_live(handle: int, features) -> torch.Tensor:
    """`fx_lookup` for a collection traced as the root (a GraphModule cannot hold its own root)."""
    return fx_lookup(live_collection(handle), features)


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> collection
_HANDLES = itertools.count(1)


def register(module) -> int:
    """A fresh handle naming `module` (each collection, and each copy of one, gets its own)."""
    handle = next(_HANDLES)
    _LIVE[handle] = module
    return handle


def live_collection(handle: int):
    module = _LIVE.get(handle)
    if module is None:
        raise RuntimeError(f"cachedemb::collection_lookup: collection {handle} no longer exists; a captured "
                           "graph runs the live CachedEmbeddingBagCollection it was captured from, in its process")
    return module


@torch.library.custom_op("cachedemb::collection_lookup", mutates_args=(),
                         schema="(int handle, str[] keys, Tensor values, Tensor lengths, Tensor? weights) -> Tensor")
def collection_lookup(handle, keys, values, lengths, weights):
    with torch.no_grad():
        return live_collection(handle)._lookup_jagged(list(keys), values, lengths, weights)


@collection_lookup.register_fake
def _collection_lookup_fake(handle, keys, values, lengths, weights):
    batch = lengths.shape[0] // max(len(keys), 1)
    return values.new_empty((batch, sum(live_collection(handle)._dims)), dtype=torch.float32)
