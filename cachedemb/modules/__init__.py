"""The drop-in module: `CachedEmbeddingBag`, nn.EmbeddingBag's constructor, forward, weight and state_dict.

Owns the module and its autograd Function, input checks (`normalize_bag_input`), the error types (each a subclass
of the one nn raises), meta-device construction (`MetaTable`, `init_rows`) and atomic checkpoint files.

May import: `cachedemb.cache`, `cachedemb.optim`, `cachedemb.kernels`. `CachedEmbeddingBag(None, dim, dynamic=...)`
builds the class `cachedemb.dynamic` registers in `factory`, never imported from here.
"""
