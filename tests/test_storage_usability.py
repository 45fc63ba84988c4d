"""What a user of a table on file sees first: byte strings for host_cache_bytes, a readable TableFile, the
snapshot a describe_snapshot() without arguments describes, and the module's hit counters on file."""
import os
import re

import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.sizing import parse_bytes
from cachedemb.storage.format import TableMismatchError

N, D = 300, 4


def test_host_cache_bytes_takes_byte_strings_as_the_sizing_cli_does():
    for text, expected in (("1MiB", 1 << 20), ("64 GiB", 64 << 30), ("512MB", 512 * 10**6), ("4096", 4096)):
        assert cachedemb.FileStorage("t.cemb", text).host_cache_bytes == expected == parse_bytes(text)
    assert cachedemb.FileStorage("t.cemb", host_cache_bytes=1 << 20) == cachedemb.FileStorage("t.cemb", "1MiB")
    for bad in ("1 parsec", "-3MB", "MiB", 0, "0B", True, 1.5):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            cachedemb.FileStorage("t.cemb", bad)


def test_an_opened_file_says_what_it_holds(tmp_path):
    path = tmp_path / "t.cemb"
    m = cachedemb.CachedEmbeddingBag(N, D, mode="sum", optimizer=optim.Adagrad(lr=0.1), device="cpu",
                                     storage=cachedemb.FileStorage(path, "64KiB"))
    m(torch.tensor([1, 2, 3]), torch.tensor([0])).sum().backward()
    m.close()
    table = cachedemb.open_table(path)
    text = repr(table)
    assert str(path) in text and f"{N} rows x {D}" in text and "float32" in text and "open read-only" in text
    assert "Adagrad (per-row state: sum, 4 columns)" in text and f"snapshots {sorted(table.snapshots)}" in text
    newest = table.describe_snapshot()
    assert newest == table.describe_snapshot(table.newest_seq) and newest["seq"] == max(table.snapshots)
    assert newest["optimizer_step"] == 1 and newest["path"] == str(path)
    assert table.describe_snapshot(min(table.snapshots))["optimizer_step"] == 0  # the creation
    with pytest.raises(KeyError, match=r"retains snapshots \[1, 2\], not 7"):
        table.describe_snapshot(7)
    table.close()
    assert repr(table).endswith("closed>")


def test_a_file_of_another_optimizer_names_both_plainly(tmp_path):
    path = tmp_path / "t.cemb"
    cachedemb.CachedEmbeddingBag(N, D, optimizer=optim.SGD(lr=0.1), device="cpu",
                                 storage=cachedemb.FileStorage(path, "64KiB")).close()
    before = path.read_bytes()
    with pytest.raises(TableMismatchError, match=re.escape(
            f"{str(path)!r} was written by SGD (no per-row state); this module uses Adagrad (per-row state: sum, "
            f"{D} columns)")):
        cachedemb.CachedEmbeddingBag(N, D, optimizer=optim.Adagrad(lr=0.1), device="cpu",
                                     storage=cachedemb.FileStorage(path, "64KiB"))
    with pytest.raises(TableMismatchError, match=r"written by Adagrad \(per-row state: sum, 4 columns\); this "
                                                 r"module uses RowWiseAdagrad \(per-row state: sum, 1 column\)"):
        other = tmp_path / "u.cemb"
        cachedemb.CachedEmbeddingBag(N, D, optimizer=optim.Adagrad(lr=0.1), device="cpu",
                                     storage=cachedemb.FileStorage(other, "64KiB")).close()
        cachedemb.CachedEmbeddingBag(N, D, optimizer=optim.RowWiseAdagrad(lr=0.1), device="cpu",
                                     storage=cachedemb.FileStorage(other, "64KiB"))
    assert path.read_bytes() == before


def test_a_table_on_file_reports_both_hit_rates(tmp_path):
    m = cachedemb.CachedEmbeddingBag(N, D, mode="sum", optimizer=optim.SGD(lr=0.1), device="cpu", cache_rows=40,
                                     storage=cachedemb.FileStorage(tmp_path / "t.cemb", "16KiB"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        m((torch.rand(30, generator=gen) ** 2 * N).long(), torch.tensor([0, 15])).sum().backward()
    s = m.cache_stats()
    assert s["hit_rate"] == s["hits"] / s["unique"] and s["hits"] + s["misses"] == s["unique"]
    host = s["host_cache"]
    assert host["misses"] > 0 and host["hit_rate"] == host["hits"] / (host["hits"] + host["misses"])
    assert isinstance(s["seconds"]["prefetch"]["read_ahead"]["unique"], float)
    m.close()
    assert os.path.exists(tmp_path / "t.cemb")
