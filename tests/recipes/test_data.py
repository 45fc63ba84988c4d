"""Tests for recipes/dlrm/data: configs, readers, synthetic generator, preprocessing, loader."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import zlib

import numpy as np
import pytest
import torch

from cachedemb.recipes.dlrm.data import (
    AVAZU,
    AVAZU_HEADER,
    CRITEO_1TB,
    CRITEO_KAGGLE,
    SYNTHETIC_CRITEO,
    DatasetConfig,
    PreprocessedSplit,
    count_lines,
    criteo_1tb,
    dense_transform,
    iter_batches,
    load_id_freq,
    load_metadata,
    preprocess_avazu,
    preprocess_criteo_1tb,
    preprocess_criteo_kaggle,
    read_avazu_csv,
    read_criteo_tsv,
    splitmix64,
    synthetic_criteo,
    write_avazu_csv,
    write_criteo_tsv,
)
from cachedemb.recipes.dlrm.data.configs import CRITEO_1TB_COUNTS


def _concat(chunks):
    return (
        np.concatenate([c.labels for c in chunks]),
        np.concatenate([c.dense for c in chunks]),
        np.concatenate([c.cats for c in chunks]),
    )


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank-sum (Mann-Whitney) AUC; ties are negligible for continuous scores."""
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores, kind="stable")] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    npos, nneg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def _criteo_line(label="1", dense=None, cats=None) -> str:
    dense = [str(i) for i in range(13)] if dense is None else dense
    cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
    return "\t".join([label, *dense, *cats]) + "\n"


# ---------------------------------------------------------------- configs


def test_criteo_kaggle_config():
    assert CRITEO_KAGGLE.num_dense == 13 and CRITEO_KAGGLE.num_cat == 26
    assert sum(CRITEO_KAGGLE.table_sizes) == 33_762_577
    assert CRITEO_KAGGLE.total_rows == 33_762_577
    assert CRITEO_KAGGLE.embedding_dim == 128


def test_criteo_1tb_cap():
    assert CRITEO_1TB.table_sizes == tuple(min(c, 40_000_000) for c in CRITEO_1TB_COUNTS)
    assert max(CRITEO_1TB.table_sizes) == 40_000_000
    small = criteo_1tb(cap=1000)
    assert max(small.table_sizes) == 1000 and small.table_sizes[5] == 3
    with pytest.raises(ValueError, match="cap"):
        criteo_1tb(cap=0)


def test_avazu_and_synthetic_configs():
    assert AVAZU.num_dense == 1 and AVAZU.num_cat == 23
    assert AVAZU.cat_names[-2:] == ("hour_of_day", "weekday") and AVAZU.table_sizes[-2:] == (24, 7)
    assert max(AVAZU.table_sizes) == 1 << 22
    assert 1_000_000 <= SYNTHETIC_CRITEO.total_rows <= 2_000_000
    assert synthetic_criteo(scale=1.0).table_sizes == CRITEO_KAGGLE.table_sizes


def test_config_validation():
    with pytest.raises(ValueError, match="2 categorical names but 1 table sizes"):
        DatasetConfig("x", "criteo_tsv", ("d",), ("a", "b"), (3,))
    with pytest.raises(ValueError, match="table size of 'a' is 0"):
        DatasetConfig("x", "criteo_tsv", ("d",), ("a",), (0,))
    with pytest.raises(ValueError, match="table size of 'a' is 2.5"):
        DatasetConfig("x", "criteo_tsv", ("d",), ("a",), (2.5,))
    with pytest.raises(ValueError, match="raw_format='parquet'"):
        DatasetConfig("x", "parquet", ("d",), ("a",), (3,))
    with pytest.raises(ValueError, match="duplicate"):
        DatasetConfig("x", "criteo_tsv", ("a",), ("a",), (3,))
    with pytest.raises(Exception):
        CRITEO_KAGGLE.embedding_dim = 64  # frozen


# ---------------------------------------------------------------- Criteo reader


def test_criteo_reader_values_and_empty_fields(tmp_path):
    p = tmp_path / "c.tsv"
    dense = ["", "-3", "12345678", *[str(i) for i in range(10)]]
    cats = ["68fd1e64", "", "FFFFFFFF", *[f"{i:x}" for i in range(23)]]
    p.write_text(_criteo_line("0", dense, cats) + _criteo_line("1", [""] * 13, [""] * 26))
    (chunk,) = list(read_criteo_tsv(p))
    assert chunk.labels.dtype == np.int8 and chunk.labels.tolist() == [0, 1]
    assert chunk.dense.dtype == np.float32 and chunk.dense.shape == (2, 13)
    assert chunk.dense[0, :3].tolist() == [0.0, -3.0, 12345678.0]
    assert (chunk.dense[1] == 0).all()
    assert chunk.cats.dtype == np.int64 and chunk.cats.shape == (2, 26)
    assert chunk.cats[0, :3].tolist() == [0x68FD1E64, 0, 0xFFFFFFFF]
    assert chunk.cats[0, 3:].tolist() == list(range(23))
    assert (chunk.cats[1] == 0).all()  # empty -> MISSING_CAT


def test_criteo_reader_chunks_and_crlf(tmp_path):
    p = tmp_path / "c.tsv"
    lines = [_criteo_line(str(i % 2), [str(i)] * 13, [f"{i:08x}"] * 26) for i in range(7)]
    p.write_bytes("".join(lines).replace("\n", "\r\n").encode().rstrip(b"\r\n"))  # CRLF, no final newline
    chunks = list(read_criteo_tsv(p, chunk_rows=3))
    assert [c.first_line for c in chunks] == [1, 4, 7]
    labels, dense, cats = _concat(chunks)
    assert labels.tolist() == [i % 2 for i in range(7)]
    assert dense[:, 0].tolist() == list(range(7)) and cats[:, 25].tolist() == list(range(7))
    assert count_lines(p) == 7


@pytest.mark.parametrize(
    "bad_line, field, expected",
    [
        ("1\t2\t3\n", "expected 40", "got 3"),
        (_criteo_line("2"), "label", "label 0 or 1"),
        (_criteo_line(""), "label", "label 0 or 1"),
        (_criteo_line("1", ["1.5"] + ["0"] * 12), "I1 (column 2)", "an integer or empty"),
        (_criteo_line("1", ["0"] * 12 + ["x7"]), "I13 (column 14)", "an integer or empty"),
        (_criteo_line("1", None, ["zz12ab00"] + ["0"] * 25), "C1 (column 15)", "hex digits"),
        (_criteo_line("1", None, ["0"] * 25 + ["1234567890abcdef0"]), "C26 (column 40)", "hex digits"),
    ],
)
def test_criteo_reader_malformed(tmp_path, bad_line, field, expected):
    p = tmp_path / "bad_criteo.tsv"
    p.write_text(_criteo_line() * 3 + bad_line + _criteo_line())
    with pytest.raises(ValueError) as info:
        for _ in read_criteo_tsv(p, chunk_rows=2):  # the bad line is in the second chunk
            pass
    msg = str(info.value)
    assert str(p) in msg and "line 4" in msg and field in msg and expected in msg


def test_criteo_reader_reports_earliest_bad_line(tmp_path):
    p = tmp_path / "c.tsv"
    p.write_text(_criteo_line("1", None, ["q"] * 26) + _criteo_line("1", ["x"] * 13) + _criteo_line("7"))
    with pytest.raises(ValueError, match=r"line 1: field C1"):
        list(read_criteo_tsv(p))


# ---------------------------------------------------------------- Avazu reader

_AVAZU_ROW = "1000009418151094273,0,14102100,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,79"


def _expected_hash(s: str) -> int:
    """Reference for the reader's hashing: hex by value, anything else (e.g. '-1', '') by BLAKE2b."""
    if re.fullmatch(r"[0-9a-fA-F]{1,15}", s):
        return int(splitmix64(np.uint64(int(s, 16))) & np.uint64((1 << 63) - 1))
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def test_avazu_reader_values(tmp_path):
    p = tmp_path / "a.csv"
    row2 = _AVAZU_ROW.replace("14102100", "14103023").replace(",0,1fbe01fe", ",,1fbe01fe").replace(",0,14", ",1,14")
    p.write_text(AVAZU_HEADER + "\n" + _AVAZU_ROW + "\n" + row2 + "\n")
    (chunk,) = list(read_avazu_csv(p))
    assert chunk.first_line == 2 and chunk.labels.tolist() == [0, 1]
    assert chunk.cats.shape == (2, 23) and chunk.dense.shape == (2, 1)
    raw = _AVAZU_ROW.split(",")[3:]
    assert chunk.cats[0, :21].tolist() == [_expected_hash(v) for v in raw]
    assert chunk.cats[1, 1] == _expected_hash("")  # empty banner_pos: stable, distinct from "0"
    assert chunk.cats[1, 1] != chunk.cats[0, 1]
    assert chunk.cats[0, 20] == _expected_hash("79") and (chunk.cats >= 0).all()
    assert chunk.cats[0, 19] == _expected_hash("-1")  # C20's frequent "-1" is not hex: hashed as a string
    # 2014-10-21 00h was a Tuesday (1); 2014-10-30 23h a Thursday (3).
    assert chunk.cats[:, 21].tolist() == [0, 23] and chunk.cats[:, 22].tolist() == [1, 3]
    np.testing.assert_allclose(chunk.dense[:, 0], [0.0, 1.0])


@pytest.mark.parametrize(
    "bad, field",
    [
        (_AVAZU_ROW.replace(",0,14102100", ",2,14102100"), "click (column 2)"),
        (_AVAZU_ROW.replace("14102100", "14023000"), "hour (column 3)"),  # Feb 30
        (_AVAZU_ROW.replace("14102100", "14102124"), "hour (column 3)"),
        (_AVAZU_ROW.replace("14102100", "1410210"), "hour (column 3)"),
        (_AVAZU_ROW + ",extra", "expected 24 comma-separated fields"),
    ],
)
def test_avazu_reader_malformed(tmp_path, bad, field):
    p = tmp_path / "bad_avazu.csv"
    p.write_text(AVAZU_HEADER + "\n" + _AVAZU_ROW + "\n" + bad + "\n")
    with pytest.raises(ValueError) as info:
        list(read_avazu_csv(p))
    msg = str(info.value)
    assert str(p) in msg and "line 3" in msg and field in msg


def test_avazu_reader_requires_header(tmp_path):
    p = tmp_path / "noheader.csv"
    p.write_text(_AVAZU_ROW + "\n")
    with pytest.raises(ValueError, match=r"line 1: expected the Avazu header"):
        list(read_avazu_csv(p))


# ---------------------------------------------------------------- synthetic generator

_SMALL_CARDS = (3, 50, 1000, 20000, 7, 300, 5000, 2, 11, 90000, 60, 400, 1500,
                4, 25, 70000, 10, 800, 120, 5, 30000, 18, 15, 9000, 105, 40000)


def test_synthetic_criteo_deterministic_and_valid(tmp_path):
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"
    write_criteo_tsv(a, 2000, _SMALL_CARDS, seed=3, missing_rate=0.05)
    write_criteo_tsv(b, 2000, _SMALL_CARDS, seed=3, missing_rate=0.05)
    write_criteo_tsv(c, 2000, _SMALL_CARDS, seed=4, missing_rate=0.05)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert count_lines(a) == 2000
    labels, dense, cats = _concat(list(read_criteo_tsv(a, chunk_rows=700)))
    assert labels.shape == (2000,) and set(np.unique(labels)) <= {0, 1}
    assert (cats < np.array(_SMALL_CARDS)).all() and (cats >= 0).all()
    assert 0.03 < (cats == 0).mean() < 0.07  # missing ~5%
    assert (dense >= 0).all()
    # Zipf: the most frequent id of a 90k-value feature takes far more than 1/90k of rows.
    present = cats[:, 9][cats[:, 9] > 0]
    assert np.bincount(present).max() / present.size > 0.02


def test_synthetic_criteo_signal_is_learnable(tmp_path):
    p = tmp_path / "s.tsv"
    signal = write_criteo_tsv(p, 20000, _SMALL_CARDS, seed=11)
    labels, dense, cats = _concat(list(read_criteo_tsv(p)))
    assert 0.1 < labels.mean() < 0.5
    assert _auc(signal.logits(cats, dense), labels) > 0.75
    # Learnable from data, not just from the oracle: per-id click rates estimated on the
    # first half (a naive-Bayes-style score) rank the second half well above chance.
    half = len(labels) // 2
    score = np.zeros(len(labels) - half)
    for f in range(cats.shape[1]):
        pos = np.bincount(cats[:half, f], weights=labels[:half], minlength=_SMALL_CARDS[f])
        cnt = np.bincount(cats[:half, f], minlength=_SMALL_CARDS[f])
        rate = np.log((pos + 1) / (cnt - pos + 3))
        score += rate[cats[half:, f]]
    assert _auc(score, labels[half:]) > 0.65


def test_synthetic_avazu_deterministic_and_valid(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_avazu_csv(a, 1500, seed=5)
    write_avazu_csv(b, 1500, seed=5)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_text().splitlines()[0] == AVAZU_HEADER
    labels, dense, cats = _concat(list(read_avazu_csv(a, chunk_rows=400)))
    assert labels.shape == (1500,) and cats.shape == (1500, 23) and dense.shape == (1500, 1)
    assert set(np.unique(cats[:, 22])) <= set(range(7)) and cats[:, 21].max() <= 23
    assert 0.02 < labels.mean() < 0.6


# ---------------------------------------------------------------- preprocessing


def test_dense_transform():
    np.testing.assert_allclose(dense_transform(np.array([0, 1, -2, -3, 1e6])),
                               np.log([3, 4, 1, 1, 1e6 + 3]).astype(np.float32), rtol=1e-6)
    assert dense_transform(np.zeros((2, 3))).dtype == np.float32


def test_preprocess_kaggle_round_trip(tmp_path):
    src = tmp_path / "train.txt"
    write_criteo_tsv(src, 3000, _SMALL_CARDS, seed=7)
    # Tables smaller than some cardinalities, so the % reduction is exercised.
    cfg = DatasetConfig("tiny", "criteo_tsv", CRITEO_KAGGLE.dense_names, CRITEO_KAGGLE.cat_names,
                        tuple(min(c, 997) for c in _SMALL_CARDS), embedding_dim=16)
    out = preprocess_criteo_kaggle(src, tmp_path / "prep", config=cfg, chunk_rows=512)
    labels, dense, cats = _concat(list(read_criteo_tsv(src)))
    meta = load_metadata(out)
    n_train = int(3000 * 6 / 7)
    n_val = int(3000 / 14)
    assert meta["rows"] == {"train": n_train, "val": n_val, "test": 3000 - n_train - n_val}
    assert meta["config"] == "tiny" and meta["table_sizes"] == list(cfg.table_sizes)
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, 3000)}
    sizes = np.array(cfg.table_sizes)
    for split, (lo, hi) in bounds.items():
        d = np.load(out / f"{split}_dense.npy", mmap_mode="r")
        s = np.load(out / f"{split}_sparse.npy", mmap_mode="r")
        y = np.load(out / f"{split}_labels.npy", mmap_mode="r")
        assert d.dtype == np.float32 and s.dtype == np.int64 and y.dtype == np.float32
        np.testing.assert_array_equal(d, dense_transform(dense[lo:hi]))
        np.testing.assert_array_equal(s, cats[lo:hi] % sizes)
        np.testing.assert_array_equal(y, labels[lo:hi].astype(np.float32))
        assert (s < sizes).all()
    freq = load_id_freq(out)
    assert [f.shape[0] for f in freq] == list(cfg.table_sizes)
    train_sparse = cats[:n_train] % sizes
    for f in range(26):
        brute = np.zeros(cfg.table_sizes[f], dtype=np.int64)
        for v in train_sparse[:, f]:
            brute[v] += 1
        np.testing.assert_array_equal(freq[f], brute)
        assert freq[f].sum() == n_train  # train only, not val/test
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_preprocess_1tb_days(tmp_path):
    days = []
    for d, n in enumerate([400, 300, 201]):
        days.append(tmp_path / f"day_{d}")
        write_criteo_tsv(days[-1], n, _SMALL_CARDS, seed=100 + d)
    # The 1TB days ship gzipped; the last one is compressed to cover that path.
    gz = tmp_path / "day_2.gz"
    gz.write_bytes(gzip.compress(days[-1].read_bytes()))
    cfg = DatasetConfig("tb", "criteo_tsv", CRITEO_KAGGLE.dense_names, CRITEO_KAGGLE.cat_names,
                        np.array(_SMALL_CARDS))
    out = preprocess_criteo_1tb(days[:2] + [gz], tmp_path / "tb", config=cfg, chunk_rows=128)
    assert load_metadata(out)["rows"] == {"train": 700, "val": 100, "test": 101}
    _, _, last = _concat(list(read_criteo_tsv(days[-1])))
    np.testing.assert_array_equal(np.load(out / "val_sparse.npy"), last[:100])
    np.testing.assert_array_equal(np.load(out / "test_sparse.npy"), last[100:])
    assert sum(int(f.sum()) for f in load_id_freq(out)) == 700 * 26


def test_preprocess_avazu_round_trip(tmp_path):
    src = tmp_path / "train.csv"
    write_avazu_csv(src, 1000, seed=9)
    out = preprocess_avazu(src, tmp_path / "av", chunk_rows=300)
    labels, dense, cats = _concat(list(read_avazu_csv(src)))
    assert load_metadata(out)["rows"] == {"train": 800, "val": 100, "test": 100}
    np.testing.assert_array_equal(np.load(out / "test_sparse.npy"), cats[900:] % np.array(AVAZU.table_sizes))
    np.testing.assert_array_equal(np.load(out / "train_dense.npy"), dense_transform(dense[:800]))
    np.testing.assert_array_equal(np.load(out / "val_labels.npy"), labels[800:900].astype(np.float32))


def test_preprocess_malformed_leaves_nothing(tmp_path):
    src = tmp_path / "train.txt"
    write_criteo_tsv(src, 1000, _SMALL_CARDS, seed=1)
    lines = src.read_text().splitlines(keepends=True)
    lines[900] = lines[900].replace("\t", "\tzz", 1)  # I1 -> non-integer, deep into the test split
    src.write_text("".join(lines))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=r"train\.txt: line 901: field I1"):
        preprocess_criteo_kaggle(src, tmp_path / "prep", config=synthetic_criteo(), chunk_rows=256)
    assert sorted(os.listdir(tmp_path)) == before


# ---------------------------------------------------------------- corrupt raw files


def _truncated_gz(tmp_path, rows=3000):
    """A gzipped Criteo day cut at half its compressed bytes; returns (path, full lines in the readable prefix)."""
    plain = tmp_path / "day_full"
    write_criteo_tsv(plain, rows, _SMALL_CARDS, seed=7)
    data = gzip.compress(plain.read_bytes())
    cut = data[: len(data) // 2]
    gz = tmp_path / "day_1.gz"
    gz.write_bytes(cut)
    readable = zlib.decompressobj(wbits=31).decompress(cut)
    return gz, readable.count(b"\n")


def test_truncated_gzip_names_file_and_line(tmp_path):
    gz, complete = _truncated_gz(tmp_path)
    assert 0 < complete < 3000
    for read in (lambda: list(read_criteo_tsv(gz, chunk_rows=256)), lambda: count_lines(gz)):
        with pytest.raises(ValueError, match="truncated or corrupt") as info:
            read()
        msg = str(info.value)
        line = int(re.search(r": line (\d+):", msg).group(1))
        assert msg.startswith(str(gz)) and 1 <= line <= complete + 1, msg


def test_file_ending_mid_line(tmp_path):
    p = tmp_path / "c.tsv"
    p.write_text(_criteo_line() * 4 + _criteo_line()[:60])  # cut inside the 5th line, no newline
    with pytest.raises(ValueError, match=r"c\.tsv: line 5: expected 40 .* fields, got \d+ \(the file ends mid-line"):
        list(read_criteo_tsv(p, chunk_rows=3))


@pytest.mark.parametrize("column", [1, 5, 20])
def test_non_ascii_bytes_name_line_and_column(tmp_path, column):
    fields = _criteo_line().rstrip("\n").encode().split(b"\t")
    fields[column - 1] = fields[column - 1][:1] + b"\xff\xfe"
    p = tmp_path / "c.tsv"
    p.write_bytes(_criteo_line().encode() * 2 + b"\t".join(fields) + b"\n" + _criteo_line().encode())
    with pytest.raises(ValueError, match=rf"c\.tsv: line 3: column {column}: non-ASCII byte 0xff"):
        list(read_criteo_tsv(p))


def test_avazu_non_ascii_category_is_an_error(tmp_path):
    # Avazu categoricals are hashed as strings, so without the check a corrupt byte would become a new id.
    p = tmp_path / "train.csv"
    bad = _AVAZU_ROW.replace("1fbe01fe", "1fbe\u00e901fe")
    p.write_bytes((AVAZU_HEADER + "\n" + _AVAZU_ROW + "\n" + bad + "\n").encode("latin-1"))
    with pytest.raises(ValueError, match=r"train\.csv: line 3: column 6: non-ASCII byte 0xe9"):
        list(read_avazu_csv(p))


def _corrupt_day(tmp_path, kind: str):
    if kind == "truncated_gz":
        return _truncated_gz(tmp_path)[0], "truncated or corrupt"
    p = tmp_path / "day_1"
    write_criteo_tsv(p, 600, _SMALL_CARDS, seed=8)
    data = p.read_bytes()
    lines = data.splitlines(keepends=True)
    if kind == "mid_line":
        p.write_bytes(data[: len(data) - len(lines[-1]) // 2])
        return p, "line 600: expected 40 .* ends mid-line"
    if kind == "field_count":
        lines[500] = lines[500].replace(b"\t", b"", 1)
        p.write_bytes(b"".join(lines))
        return p, "line 501: expected 40 .* got 39"
    lines[550] = lines[550][:20] + b"\x80" + lines[550][20:]
    p.write_bytes(b"".join(lines))
    return p, "line 551: column \\d+: non-ASCII byte 0x80"


@pytest.mark.parametrize("kind", ["truncated_gz", "mid_line", "field_count", "non_ascii"])
def test_preprocess_corrupt_input_leaves_no_partial_output(tmp_path, kind):
    day0 = tmp_path / "day_0"
    write_criteo_tsv(day0, 500, _SMALL_CARDS, seed=9)
    bad, message = _corrupt_day(tmp_path, kind)
    cfg = DatasetConfig("tb", "criteo_tsv", CRITEO_KAGGLE.dense_names, CRITEO_KAGGLE.cat_names, _SMALL_CARDS)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=message):
        preprocess_criteo_1tb([day0, bad], tmp_path / "out", config=cfg, chunk_rows=128)
    assert sorted(os.listdir(tmp_path)) == before  # no output dir, no temp dir left behind
    # overwrite=True over a good earlier output: the failure keeps it whole.
    good = preprocess_criteo_1tb([day0, day0], tmp_path / "out", config=cfg)
    files = {f: (good / f).read_bytes() for f in os.listdir(good)}
    with pytest.raises(ValueError, match=message):
        preprocess_criteo_1tb([day0, bad], good, config=cfg, chunk_rows=128, overwrite=True)
    assert {f: (good / f).read_bytes() for f in os.listdir(good)} == files
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["out"])


def test_preprocess_refuses_to_overwrite(tmp_path):
    src = tmp_path / "train.txt"
    write_criteo_tsv(src, 200, _SMALL_CARDS, seed=1)
    cfg = DatasetConfig("o", "criteo_tsv", CRITEO_KAGGLE.dense_names, CRITEO_KAGGLE.cat_names, _SMALL_CARDS)
    out = preprocess_criteo_kaggle(src, tmp_path / "prep", config=cfg)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        preprocess_criteo_kaggle(src, out, config=cfg)
    preprocess_criteo_kaggle(src, out, config=cfg, train_fraction=0.5, val_fraction=0.25, overwrite=True)
    assert json.loads((out / "metadata.json").read_text())["rows"] == {"train": 100, "val": 50, "test": 50}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep", "train.txt"]
    with pytest.raises(ValueError, match="format 'avazu_csv' produces 1 / 23"):
        preprocess_avazu(src, tmp_path / "x", config=cfg.__class__("a", "avazu_csv", cfg.dense_names,
                                                                    cfg.cat_names, cfg.table_sizes))


# ---------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    write_criteo_tsv(root / "train.txt", 1000, _SMALL_CARDS, seed=2)
    cfg = DatasetConfig("l", "criteo_tsv", CRITEO_KAGGLE.dense_names, CRITEO_KAGGLE.cat_names, _SMALL_CARDS)
    return preprocess_criteo_kaggle(root / "train.txt", root / "prep", config=cfg, train_fraction=0.7,
                                    val_fraction=0.1)


def test_loader_batches(prepared):
    split = PreprocessedSplit(prepared, "train")
    assert split.num_rows == 700 and split.num_batches(64) == 11 and split.num_batches(64, drop_last=True) == 10
    dense = np.load(prepared / "train_dense.npy")
    sparse = np.load(prepared / "train_sparse.npy")
    labels = np.load(prepared / "train_labels.npy")
    got = list(split.batches(64))
    assert len(got) == 11 and got[-1].labels.shape == (700 - 640,)
    for i, (d, s, y) in enumerate(got):
        assert d.dtype == torch.float32 and s.dtype == torch.int64 and y.dtype == torch.float32
        assert d.shape[1] == 13 and s.shape[1] == 26
        np.testing.assert_array_equal(d.numpy(), dense[i * 64 : (i + 1) * 64])
        np.testing.assert_array_equal(s.numpy(), sparse[i * 64 : (i + 1) * 64])
        np.testing.assert_array_equal(y.numpy(), labels[i * 64 : (i + 1) * 64])
    assert all(b.labels.shape[0] == 64 for b in split.batches(64, drop_last=True))
    # Writing into a batch must not touch the file.
    got[0].dense.fill_(123.0)
    assert not (np.load(prepared / "train_dense.npy")[:64] == 123.0).any()


def test_loader_shuffle_resume_and_limit(prepared):
    def firsts(**kw):
        return [int(b.sparse[0, 25]) * 10_000 + int(b.labels.shape[0]) for b in iter_batches(prepared, "train", 50, **kw)]

    plain = firsts()
    shuffled = firsts(shuffle=True, seed=1)
    assert sorted(shuffled) == sorted(plain) and shuffled != plain
    assert firsts(shuffle=True, seed=1) == shuffled
    assert firsts(shuffle=True, seed=1, epoch=1) != shuffled
    assert firsts(shuffle=True, seed=1, start_batch=5) == shuffled[5:]
    assert firsts(shuffle=True, seed=1, start_batch=5, limit_batches=3) == shuffled[5:8]
    assert firsts(start_batch=14) == []
    assert len(list(iter_batches(prepared, "val", 32))) == 4 and len(list(iter_batches(prepared, "test", 1000))) == 1
    with pytest.raises(ValueError, match="start_batch=15"):
        iter_batches(prepared, "train", 50, start_batch=15)
    with pytest.raises(ValueError, match="split='dev'"):
        PreprocessedSplit(prepared, "dev")
