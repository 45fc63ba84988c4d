"""Module classes that layers above `cachedemb.modules` register, so a module here can build them by name.

`CachedEmbeddingBag(..., storage=FileStorage(...))` likewise returns the file-backed module of `cachedemb.storage`.

`CachedEmbeddingBag(None, dim, ..., dynamic=DynamicIds(...))` returns a `DynamicEmbeddingBag`, which lives in
`cachedemb.dynamic` (above this layer: it wraps a CachedEmbeddingBag). Importing it from here would make the two
import each other; instead `cachedemb.dynamic` registers its class when it is imported (`import cachedemb` does).
"""
from __future__ import annotations

_dynamic_class = None
_storage_class = None


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


def register_storage(cls):
    """Class decorator: `cls` is what `CachedEmbeddingBag(..., storage=...)` builds (cachedemb.storage)."""
    global _storage_class
    _storage_class = cls
    return cls


def build_storage(*args, storage, **kwargs):
    """The registered file-backed module, built with CachedEmbeddingBag's arguments."""
    if _storage_class is None:
        raise RuntimeError("CachedEmbeddingBag(..., storage=...) needs cachedemb.storage, which registers the "
                           "file-backed module when imported: `import cachedemb` (or cachedemb.storage) first")
    return _storage_class(*args, storage=storage, **kwargs)
