"""Sharded tables on file: each rank keeps the rows the plan gives it in a file of its own.

A table built on the meta device with `storage=FileStorage(path, host_cache_bytes)` (a collection: one
`<directory>/<table>.cemb` per table) is sharded by `shard()` into one file per rank that keeps rows:
`<stem>.rank<r>of<w>.cemb` beside `path`. Its header records the rows it holds ([start, end) of the table's
rows), the rank and the world size. A new rank file is filled by streaming the table's whole init stream and
keeping the rank's rows (what one process draws for them; every rank's generator ends where one process's
does); an existing one is opened and checked: another rank's file, or a file of a job with another world size or
plan, raises `TableMismatchError` naming it. Files are never resharded: a job continues at the world size and
plan it was created with (export the rows to change either).

Checkpoints (`cachedemb.distributed.checkpoint`): a rank's table on file saves a snapshot descriptor (the file's
uuid, the committed snapshot, the optimizer step) under keys of its own, `<table>.storage.rank<r>of<w>.*`, never
its rows; a load rolls each rank's file back to the snapshot its descriptor names.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import torch

from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.modules.meta_init import iter_init_range
from cachedemb.storage.embedding_bag import FileBackedEmbeddingBag, FileStorage
from cachedemb.storage.format import TableMismatchError

def rank_file(path, rank: int, world_size: int) -> Path:
    """`<dir>/<stem>.rank<r>of<w><suffix>` for the table file `path` (suffix `.cemb` as given)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}of{world_size}{path.suffix}")


def _other_files(path: Path, world_size: int) -> list[Path]:
    """Files of this table from a job of another world size, and the unsharded file (one process's)."""
    out = [path] if path.exists() else []
    pattern = re.compile(re.escape(path.stem) + r"\.rank(\d+)of(\d+)" + re.escape(path.suffix))
    if path.parent.is_dir():
        for f in sorted(path.parent.glob(f"{path.stem}.rank*of*{path.suffix}")):
            m = pattern.fullmatch(f.name)
            if m and int(m.group(2)) != world_size:
                out.append(f)
    return out


def rank_table(module: CachedEmbeddingBag, start: int, end: int, rank: int, world_size: int, device,
               pooling: str) -> FileBackedEmbeddingBag | None:
    """This rank's rows [start, end) of the meta `module` (built with storage=) in this rank's file: created by
    streaming (the whole table's init drawn, these rows kept) or opened and checked. None for an empty range
    (the init stream is still drawn, so every rank's generator stays in step)."""
    storage: FileStorage = module.file_storage
    spec = module.cache
    path = Path(storage.path)
    mine = rank_file(path, rank, world_size)
    others = _other_files(path, world_size)
    if others:
        raise TableMismatchError(
            f"table file {str(others[0])!r} holds this table for "
            f"{'one process' if others[0] == path else 'a job of another world size'}, but this job has "
            f"{world_size} ranks: a table on file is not resharded (run at the world size it was created with, or "
            "export its rows and import them into new files)")
    if end == start:
        if mine.exists():
            raise TableMismatchError(f"table file {str(mine)!r} holds rows of this table for rank {rank}, but the "
                                     "plan gives that rank none (a job with another plan): a table on file is not "
                                     "resharded; shard with the plan it was created with")
        if not spec.init.elementwise:
            raise ValueError("a table on file streams its initial rows: its init must draw element by element")
        for _ in iter_init_range(spec.init, module.num_embeddings, module.embedding_dim, spec.dtype, 0, 0):
            pass  # the whole table's draws, as the ranks keeping rows make them
        return None
    rows = end - start
    shard = {"rank": rank, "world_size": world_size, "start": start, "end": end, "table_rows": module.num_embeddings}
    created = not mine.exists()
    freq = spec.id_freq[start:end].clone() if spec.id_freq is not None and created else None
    table = FileBackedEmbeddingBag(
        rows, module.embedding_dim, max_norm=module.max_norm, norm_type=module.norm_type,
        scale_grad_by_freq=module.scale_grad_by_freq, mode=pooling, sparse=module.sparse, include_last_offset=True,
        device=device, dtype=spec.dtype, storage=replace(storage, path=mine), optimizer=module.optimizer,
        _freeze=module.optimizer is None and not module._requires_grad, validate_inputs=False,
        cache_rows=max(1, min(rows, math.ceil(spec.capacity * rows / module.num_embeddings))), id_freq=freq,
        policy=spec.policy, _init=spec.init, _shard=shard)
    if not created and spec.init.elementwise:
        for _ in iter_init_range(spec.init, module.num_embeddings, module.embedding_dim, spec.dtype, 0, 0):
            pass  # an opened file: the generator still moves as if the rows were drawn (same as a new job)
    table.inner._shard_local = True
    return table


def descriptor_keys(rank: int, world_size: int) -> tuple[str, str, str]:
    """A rank file's checkpoint keys (uuid, snapshot, optimizer step), under the table's prefix."""
    base = f"storage.rank{rank}of{world_size}"
    return f"{base}.uuid", f"{base}.snapshot", f"{base}.step"


def save_descriptor(table: FileBackedEmbeddingBag, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Commit a snapshot of this rank's file and name it (no rows)."""
    state: dict = {}
    table._save_to_state_dict(state, "", False)
    uuid, snap, step = descriptor_keys(rank, world_size)
    return {uuid: state["storage.uuid"], snap: state["storage.snapshot"], step: state["optimizer.step"]}


def descriptor_placeholders(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Tensors a checkpoint load fills with a rank file's descriptor."""
    uuid, snap, step = descriptor_keys(rank, world_size)
    return {uuid: torch.zeros(16, dtype=torch.uint8), snap: torch.zeros((), dtype=torch.int64),
            step: torch.zeros((), dtype=torch.int64)}


def load_descriptor(table: FileBackedEmbeddingBag, state: dict, rank: int, world_size: int, where: str) -> None:
    """Roll this rank's file back to the snapshot `state` names (keys of `descriptor_keys`)."""
    uuid, snap, step = descriptor_keys(rank, world_size)
    missing = [k for k in (uuid, snap, step) if k not in state]
    if missing:
        raise KeyError(f"{where}: the checkpoint has no {missing[0]!r} for table file {str(table.table.path)!r} "
                       f"(saved by a job of another world size, or with the table in memory)")
    errors: list[str] = []
    table._load_from_state_dict({"storage.uuid": state[uuid], "storage.snapshot": state[snap],
                                 "optimizer.step": state[step]}, "", {}, True, [], [], errors)
    if errors:
        raise RuntimeError(f"{where}: " + "; ".join(errors))


__all__ = ["descriptor_keys", "descriptor_placeholders", "load_descriptor", "rank_file", "rank_table", "save_descriptor"]
