"""Exceptions for bad input, each a subclass of both the type this library raised first and the type
`nn.EmbeddingBag` raises for the same mistake, so an `except` written for either keeps working."""
from __future__ import annotations


class InvalidIdError(IndexError, RuntimeError):
    """An id outside [0, num_embeddings) (nn.EmbeddingBag: RuntimeError)."""


class InvalidOffsetsError(ValueError, RuntimeError):
    """offsets[0] != 0, decreasing offsets, or offsets past the input (nn.EmbeddingBag: RuntimeError)."""


class InvalidInputTypeError(TypeError, RuntimeError):
    """Ids that are not int32/int64, or per_sample_weights of another dtype than the table (RuntimeError)."""


class NotATensorError(TypeError, AttributeError):
    """Ids or offsets given as something other than a tensor (nn.EmbeddingBag: AttributeError on `.dim()`)."""


class UnsupportedModeError(ValueError, NotImplementedError):
    """per_sample_weights outside mode='sum' (nn.EmbeddingBag: NotImplementedError)."""


class InvalidPaddingIdxError(ValueError, AssertionError):
    """padding_idx outside [-num_embeddings, num_embeddings) (nn.EmbeddingBag: AssertionError)."""


class InvalidWeightShapeError(ValueError, AssertionError):
    """_weight of another shape than (num_embeddings, embedding_dim) (nn.EmbeddingBag: AssertionError)."""


class NotAnIntegerError(TypeError, IndexError):
    """A size or index argument that is not an integer: numpy integers, 0-d integer tensors and anything with
    `__index__` are (nn.EmbeddingBag: TypeError for sizes, IndexError for padding_idx)."""


class NegativeSizeError(ValueError, RuntimeError):
    """A negative num_embeddings or embedding_dim (nn.EmbeddingBag: RuntimeError from torch.empty)."""


class InvalidWeightDtypeError(TypeError, RuntimeError):
    """A table of a dtype the cache cannot hold, e.g. an integer tensor bound through `weight.data = t`
    (nn.EmbeddingBag: RuntimeError)."""


class StaleTableWriteError(RuntimeError):
    """The host table was written through a reference to `weight` held across fused training steps whose
    updates are still in the cache: applying either would silently drop the other."""


class NotScriptableError(RuntimeError):
    """torch.jit.script / torch.jit.trace of a cached module: its cache is Python-side state."""


class CacheTooSmallWarning(UserWarning):
    """A batch looked up more distinct ids than the device cache has rows: the rest were served from the host
    table (exact, but every such lookup reads host memory)."""
