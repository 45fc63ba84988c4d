"""cachedemb: nn.EmbeddingBag with the table in host memory behind a frequency-aware device cache."""
from cachedemb import optim, sizing
from cachedemb.modules.checkpoint import load_checkpoint, save_checkpoint
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag, DynamicIds
from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection, TableConfig
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.kernels.native import native_available
from cachedemb.materialize import materialize
from cachedemb.prefetch import prefetch
from cachedemb.storage.embedding_bag import FileBackedEmbeddingBag, FileStorage, open_table

__all__ = ["CachedEmbeddingBag", "CachedEmbeddingBagCollection", "DynamicEmbeddingBag", "DynamicIds", "FileBackedEmbeddingBag",
           "FileStorage", "TableConfig", "load_checkpoint", "materialize", "native_available", "open_table", "optim",
           "prefetch", "save_checkpoint", "sizing"]
__version__ = "0.1.0"
