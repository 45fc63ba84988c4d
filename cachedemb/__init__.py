"""cachedemb: nn.EmbeddingBag with the table in host memory behind a frequency-aware device cache."""
from cachedemb import optim
from cachedemb.embedding_bag import CachedEmbeddingBag

__all__ = ["CachedEmbeddingBag", "optim"]
__version__ = "0.1.0"
