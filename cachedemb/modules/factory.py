"""Module classes that layers above `cachedemb.modules` register, so a module here can build them by name.

`CachedEmbeddingBag(None, dim, ..., dynamic=DynamicIds(...))` returns a `DynamicEmbeddingBag`, which lives in
`cachedemb.dynamic` (above this layer: it wraps a CachedEmbeddingBag). Importing it from here would make the two
import each other; instead `cachedemb.dynamic` registers its class when it is imported (`import cachedemb` does).
"""
from __future__ import annotations

_dynamic_class = None


def register_dynamic(cls):
    """Class decorator: `cls` is what `CachedEmbeddingBag(..., dynamic=...)` builds."""
    global _dynamic_class
    _dynamic_class = cls
    return cls


def build_dynamic(*args, dynamic, **kwargs):
    """The registered raw-id module, built with CachedEmbeddingBag's arguments."""
    if _dynamic_class is None:
        raise RuntimeError("CachedEmbeddingBag(..., dynamic=...) needs cachedemb.dynamic, which registers the raw-id "
                           "module when imported: `import cachedemb` (or cachedemb.dynamic) first")
    return _dynamic_class(*args, dynamic=dynamic, **kwargs)
