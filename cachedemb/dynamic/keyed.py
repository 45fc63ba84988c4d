"""The serving form of a trained dynamic-id table (DynamicEmbeddingBag.export_keyed()): sorted raw ids + rows,
looked up by binary search; plain torch ops only, so torch.export traces it."""
from __future__ import annotations

import torch
from torch import nn


class KeyedEmbeddingBag(nn.Module):
    """Raw int64 ids -> rows by binary search over sorted `ids`; unknown ids read row n (the unadmitted row),
    the raw `padding_idx` reads row n + 1 (excluded from pooling, as nn.EmbeddingBag's padding_idx)."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor, mode: str, padding_idx: int | None,
                 include_last_offset: bool = False):
        super().__init__()
        n = ids.numel()
        # One trailing key so the search result can always be read back (it never counts as found: pos < n).
        self.register_buffer("ids", torch.cat([ids, torch.zeros(1, dtype=torch.int64)]))
        self.register_buffer("weight", weight)
        self.n, self.mode, self.padding_idx = n, mode, padding_idx
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        raw = input.to(torch.int64)
        pos = torch.searchsorted(self.ids[: self.n], raw)
        found = (pos < self.n) & (self.ids[pos] == raw)
        rows = torch.where(found, pos, self.n)
        pad = None
        if self.padding_idx is not None:
            pad = self.n + 1
            rows = torch.where(raw == self.padding_idx, pad, rows)
        return nn.functional.embedding_bag(rows, self.weight, offsets, mode=self.mode,
                                           per_sample_weights=per_sample_weights,
                                           include_last_offset=self.include_last_offset, padding_idx=pad)
