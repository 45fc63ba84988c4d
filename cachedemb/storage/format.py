"""The table file's format: a versioned header, a writer record, two superblocks, then fixed-size blocks.

```
offset 0       header (4 KiB): magic, format version, crc32, JSON layout (shape, dtype, optimizer state layout,
               record layout, rows per block, uuid, how the rows were first filled); written once at creation
offset 4 KiB   writer record: who has the file open for writing (pid, host, since); "closed" after a clean close
offset 8 KiB   superblock slot 0    each: magic, seq, where the snapshot's chunk map lies, blocks in use, crc32,
offset 12 KiB  superblock slot 1    JSON metadata (optimizer step, time); the two newest snapshots
offset 16 KiB  blocks of `block_bytes`: chunk data (`rows_per_block` records) and chunk maps
```

A record is one row with everything that travels with it: the weight (dim values in the table's dtype), each
optimizer state (its columns in the state dtype), the access count (int64), each field 8-byte aligned. Row r lives
in chunk r // rows_per_block, at record r % rows_per_block of the block that chunk's map entry names.

Why two superblocks: a commit writes the snapshot's map into free blocks, makes it durable, then overwrites the
slot of the *older* snapshot (higher seq wins; a torn slot fails its crc and the other one stands). Blocks that
either snapshot names are never written, so the newest committed snapshot survives a crash at any instant, and
the one before it stays loadable until the next commit (a checkpoint file written against it still finds it).
"""
from __future__ import annotations

import errno

import json
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"CEMBTBL\x00"
WRITER_MAGIC = b"CEMBWRTR"
SUPER_MAGIC = b"CEMBSUPR"
FORMAT_VERSION = 1
PAGE = 4096
HEADER_OFFSET, WRITER_OFFSET = 0, PAGE
SUPER_OFFSETS = (2 * PAGE, 3 * PAGE)
DATA_OFFSET = 4 * PAGE
_HEADER = struct.Struct("<8sIII")  # magic, version, json bytes, crc32 of the json
_WRITER = struct.Struct("<8sIIQd64sI")  # magic, open, pid, token, since, host, crc32
_SUPER = struct.Struct("<8sQQQQI")  # magic, seq, map offset, map bytes, blocks in use (high water), json bytes
SHARD_KEYS = ("rank", "world_size", "start", "end", "table_rows")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class TableFileError(ValueError):
    """A file that is not a readable table, or not the table expected; the message names the file."""


class CorruptTableError(TableFileError):
    """Truncated, torn or foreign bytes where a table file's structure should be."""


class TableMismatchError(TableFileError):
    """A valid table file holding another table than the one asked for (shape, dtype, optimizer, uuid)."""


class TableWriterDiedError(RuntimeError):
    """The file's last writer did not close it: rows written after its last commit are lost. The last
    committed snapshot is intact; `snapshot` describes it. Open with `recover=True` to continue from it."""

    def __init__(self, message: str, snapshot: dict | None = None):
        super().__init__(message)
        self.snapshot = snapshot


class TableLockedError(RuntimeError):
    """Another live process has the file open for writing."""


class TableIOError(OSError):
    """The operating system refused an I/O call on a table file (a full disk, an I/O error, a file-size limit, a
    read-only remount). The rows updated since the last commit can no longer be trusted, so the table refuses
    every later use; the last committed snapshot is intact on disk. `close()` releases the file; reopen it with
    `recover=True` to continue from that snapshot. errno, strerror and filename are the failed call's."""

    def __init__(self, path, operation: str, cause: OSError, snapshot: dict):
        self.operation, self.snapshot, self.cause = operation, snapshot, cause
        step = snapshot.get("optimizer_step")
        at = f"snapshot {snapshot['seq']}" + (f", optimizer step {step}" if step is not None else "")
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        message = (f"table file {str(path)!r}: {operation} failed: {cause.strerror or cause} ({name}). The last "
                   f"committed snapshot ({at}) is intact on disk; rows updated since it are lost. close() the table, free "
                   f"the space or fix the disk, and open it again with recover=True (FileStorage(..., "
                   f"recover=True)) to continue from {at.split(',')[0]}")
        super().__init__(cause.errno, message, str(path))
        self.reported = False  # raised on a thread the caller waits on (not only on an I/O thread)

    def __str__(self) -> str:
        return self.strerror


class UncommittedRowsLostWarning(UserWarning):
    """A table closed after an I/O error: the rows updated since its last commit were not written."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str, path) -> torch.dtype:
    if name not in _DTYPES:
        raise CorruptTableError(f"table file {str(path)!r}: unknown dtype {name!r} in its header")
    return _DTYPES[name]


def _align(n: int, to: int = 8) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RecordLayout:
    """Where each field of a row sits in its record (byte offsets, 8-aligned) and how it is typed."""

    dim: int
    dtype: torch.dtype
    state_cols: tuple[tuple[str, int, float], ...]  # (name, columns, initial value)
    state_dtype: torch.dtype

    @property
    def weight_bytes(self) -> int:
        return self.dim * torch.empty(0, dtype=self.dtype).element_size()

    def state_offsets(self) -> dict[str, int]:
        out, at = {}, _align(self.weight_bytes)
        size = torch.empty(0, dtype=self.state_dtype).element_size()
        for name, cols, _ in self.state_cols:
            out[name] = at
            at = _align(at + cols * size)
        return out

    @property
    def count_offset(self) -> int:
        size = torch.empty(0, dtype=self.state_dtype).element_size()
        at = _align(self.weight_bytes)
        for _, cols, _ in self.state_cols:
            at = _align(at + cols * size)
        return at

    @property
    def record_bytes(self) -> int:
        return self.count_offset + 8

    # ---- records <-> row tensors (views of a uint8 [k, record_bytes] buffer)
    def weight_view(self, records: torch.Tensor) -> torch.Tensor:
        return records[:, : self.weight_bytes].view(self.dtype)

    def state_view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        at = self.state_offsets()[name]
        cols = dict((n, c) for n, c, _ in self.state_cols)[name]
        size = torch.empty(0, dtype=self.state_dtype).element_size()
        return records[:, at: at + cols * size].view(self.state_dtype)

    def count_view(self, records: torch.Tensor) -> torch.Tensor:
        return records[:, self.count_offset: self.count_offset + 8].view(torch.int64).view(-1)

    def pack(self, weight: torch.Tensor, states: dict[str, torch.Tensor], counts: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """[k, record_bytes] uint8 records of k rows (padding bytes zero)."""
        k = weight.shape[0]
        if out is None:
            out = torch.zeros(k, self.record_bytes, dtype=torch.uint8)
        self.weight_view(out).copy_(weight)
        for name, _, _ in self.state_cols:
            self.state_view(out, name).copy_(states[name])
        self.count_view(out).copy_(counts)
        return out


@dataclass(frozen=True)
class TableHeader:
    """What a table file holds: its shape, dtype, optimizer state layout, block geometry and identity."""

    num_rows: int
    dim: int
    dtype: torch.dtype
    state_cols: tuple[tuple[str, int, float], ...]
    optimizer: str  # repr of the optimizer spec whose state the records carry ("" for none)
    rows_per_block: int
    uuid: str
    init: str  # how the rows were first filled: "normal", "weight", "uniform", ...
    created: float
    # A sharded job's file of one rank's rows (cachedemb.distributed): {"rank", "world_size", "start", "end",
    # "table_rows"}: rows [start, end) of a table of table_rows rows; None for a whole table (absent in the JSON).
    shard: dict | None = None

    def describe_shard(self) -> str:
        s = self.shard
        if s is None:
            return f"a whole table of {self.num_rows} rows"
        return (f"rows [{s['start']}, {s['end']}) of a table of {s['table_rows']} rows, for rank {s['rank']} of a "
                f"{s['world_size']}-rank job")

    @property
    def layout(self) -> RecordLayout:
        state_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        return RecordLayout(self.dim, self.dtype, self.state_cols, state_dtype)

    @property
    def block_bytes(self) -> int:
        return _align(self.rows_per_block * self.layout.record_bytes, PAGE)

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.num_rows // self.rows_per_block))

    def encode(self) -> bytes:
        doc = {"format": FORMAT_VERSION, "num_rows": self.num_rows, "dim": self.dim,
               "dtype": dtype_name(self.dtype), "state": [list(s) for s in self.state_cols],
               "optimizer": self.optimizer, "rows_per_block": self.rows_per_block, "uuid": self.uuid,
               "init": self.init, "created": self.created, "record_bytes": self.layout.record_bytes,
               "state_offsets": self.layout.state_offsets(), "count_offset": self.layout.count_offset}
        if self.shard is not None:
            doc["shard"] = {k: int(self.shard[k]) for k in SHARD_KEYS}
        body = json.dumps(doc, sort_keys=True).encode()
        if _HEADER.size + len(body) > PAGE:
            raise ValueError(f"table header of {len(body)} bytes does not fit in {PAGE - _HEADER.size}")
        raw = _HEADER.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body)) + body
        return raw + b"\0" * (PAGE - len(raw))

    @staticmethod
    def decode(raw: bytes, path) -> "TableHeader":
        if len(raw) < _HEADER.size:
            raise CorruptTableError(f"{str(path)!r} is not a cachedemb table file: {len(raw)} bytes, shorter "
                                    "than its header (a truncated file?)")
        magic, version, size, crc = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise CorruptTableError(f"{str(path)!r} is not a cachedemb table file (its first bytes are "
                                    f"{magic!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise CorruptTableError(f"table file {str(path)!r} has format version {version}; this cachedemb "
                                    f"reads version {FORMAT_VERSION}")
        body = raw[_HEADER.size: _HEADER.size + size]
        if len(body) != size or zlib.crc32(body) != crc:
            raise CorruptTableError(f"table file {str(path)!r}: its header fails its checksum (damaged file)")
        doc = json.loads(body)
        header = TableHeader(int(doc["num_rows"]), int(doc["dim"]), parse_dtype(doc["dtype"], path),
                             tuple((str(n), int(c), float(v)) for n, c, v in doc["state"]), str(doc["optimizer"]),
                             int(doc["rows_per_block"]), str(doc["uuid"]), str(doc["init"]), float(doc["created"]),
                             {k: int(doc["shard"][k]) for k in SHARD_KEYS} if doc.get("shard") is not None else None)
        if header.layout.record_bytes != doc["record_bytes"]:
            raise CorruptTableError(f"table file {str(path)!r}: record size {doc['record_bytes']} in its header "
                                    f"disagrees with its layout ({header.layout.record_bytes})")
        return header


@dataclass(frozen=True)
class WriterRecord:
    """Who holds the file open for writing; `open` stays set if that process died without closing."""

    open: bool
    pid: int = 0
    token: int = 0
    since: float = 0.0
    host: str = ""

    def encode(self) -> bytes:
        host = self.host.encode()[:64]
        body = _WRITER.pack(WRITER_MAGIC, int(self.open), self.pid, self.token, self.since,
                            host.ljust(64, b"\0"), 0)
        crc = zlib.crc32(body[:-4])
        return body[:-4] + struct.pack("<I", crc)

    @staticmethod
    def decode(raw: bytes) -> "WriterRecord | None":
        """None when the record is torn or absent (treated as: the writer may have died)."""
        if len(raw) < _WRITER.size:
            return None
        magic, is_open, pid, token, since, host, crc = _WRITER.unpack_from(raw)
        if magic != WRITER_MAGIC or zlib.crc32(raw[: _WRITER.size - 4]) != crc:
            return None
        return WriterRecord(bool(is_open), pid, token, since, host.rstrip(b"\0").decode(errors="replace"))


@dataclass(frozen=True)
class Superblock:
    """One committed snapshot: its sequence number, where its chunk map lies, and the blocks in use then."""

    seq: int
    map_offset: int
    map_bytes: int
    high_water: int  # blocks [0, high_water) existed when it was committed
    meta: dict

    def encode(self) -> bytes:
        body = json.dumps(self.meta, sort_keys=True).encode()
        head = _SUPER.pack(SUPER_MAGIC, self.seq, self.map_offset, self.map_bytes, self.high_water, len(body))
        raw = head + body
        raw += struct.pack("<I", zlib.crc32(raw))
        if len(raw) > PAGE:
            raise ValueError(f"snapshot metadata of {len(body)} bytes does not fit in a superblock")
        return raw + b"\0" * (PAGE - len(raw))

    @staticmethod
    def decode(raw: bytes) -> "Superblock | None":
        """None for an empty, torn or foreign slot."""
        if len(raw) < _SUPER.size + 4:
            return None
        magic, seq, map_offset, map_bytes, high_water, size = _SUPER.unpack_from(raw)
        end = _SUPER.size + size
        if magic != SUPER_MAGIC or end + 4 > len(raw):
            return None
        (crc,) = struct.unpack_from("<I", raw, end)
        if zlib.crc32(raw[:end]) != crc:
            return None
        return Superblock(seq, map_offset, map_bytes, high_water, json.loads(raw[_SUPER.size:end]))
