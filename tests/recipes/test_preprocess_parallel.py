"""Parallel preprocessing writes the same bytes as the serial run, names the same bad line, and splits work."""
import gzip
import os

import pytest

from cachedemb.recipes.dlrm.data import (AVAZU, CRITEO_KAGGLE, DatasetConfig, preprocess_avazu, preprocess_criteo_1tb,
                               preprocess_criteo_kaggle, write_avazu_csv, write_criteo_tsv)
from cachedemb.recipes.dlrm.data.parallel import balance_features, plan_units

CARDS = (3, 50, 1000, 20000, 7, 300, 5000, 2, 11, 90000, 60, 400, 1500,
         9, 2500, 40000, 4, 700, 80, 5, 30000, 18, 15, 800, 105, 1400)
CFG = DatasetConfig("small", "criteo_tsv", CRITEO_KAGGLE.dense_names, CRITEO_KAGGLE.cat_names, CARDS)
SMALL_AVAZU = DatasetConfig("avazu_small", "avazu_csv", AVAZU.dense_names, AVAZU.cat_names,
                            tuple(min(s, 5000) for s in AVAZU.table_sizes))


def _files(d):
    return {name: (d / name).read_bytes() for name in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    root = tmp_path_factory.mktemp("days")
    paths = []
    for d, n in enumerate([1500, 900, 700]):
        paths.append(root / f"day_{d}")
        write_criteo_tsv(paths[-1], n, CARDS, seed=20 + d)
    # day_1 gzipped (one unit: a gzip stream cannot be entered mid-way); day_2 without its final newline.
    gz = root / "day_1.gz"
    gz.write_bytes(gzip.compress(paths[1].read_bytes()))
    paths[2].write_bytes(paths[2].read_bytes().rstrip(b"\n"))
    return [paths[0], gz, paths[2]]


def test_units_cut_at_line_starts(days):
    units = plan_units(days, 0, split_bytes=5000)
    assert len(units[0]) > 20 and len(units[1]) == 1 and units[1][0].end is None
    data = days[0].read_bytes()
    assert [u.start for u in units[0]][0] == 0 and units[0][-1].end == len(data)
    for a, b in zip(units[0][:-1], units[0][1:]):
        assert a.end == b.start and data[b.start - 1:b.start] == b"\n"


@pytest.mark.parametrize("workers", [2, 3])
def test_parallel_output_equals_serial(days, tmp_path, workers):
    serial = preprocess_criteo_1tb(days, tmp_path / "serial", config=CFG, chunk_rows=128, workers=1)
    # 5 kB units (~20 lines) and 128-line chunks: unit ends fall inside chunks and the reverse.
    par = preprocess_criteo_1tb(days, tmp_path / "par", config=CFG, chunk_rows=128, workers=workers,
                                split_bytes=5000)
    assert _files(serial) == _files(par)
    seen = []  # with a progress callback the units are polled (futures, a shared row counter): the same bytes
    watched = preprocess_criteo_1tb(days, tmp_path / "watched", config=CFG, chunk_rows=128, workers=workers,
                                    split_bytes=5000, progress=lambda *a: seen.append(a))
    assert _files(serial) == _files(watched) and ("parsing", 3100, 3100, "samples") in seen


def test_parallel_kaggle_single_file_and_avazu_equal_serial(days, tmp_path):
    a = preprocess_criteo_kaggle(days[0], tmp_path / "ks", config=CFG, workers=1)
    b = preprocess_criteo_kaggle(days[0], tmp_path / "kp", config=CFG, workers=2, split_bytes=3000)
    assert _files(a) == _files(b)
    csv = tmp_path / "train.csv"
    write_avazu_csv(csv, 1200, seed=4)
    a = preprocess_avazu(csv, tmp_path / "as", config=SMALL_AVAZU, chunk_rows=100, workers=1)
    b = preprocess_avazu(csv, tmp_path / "ap", config=SMALL_AVAZU, chunk_rows=100, workers=2, split_bytes=4000)
    assert _files(a) == _files(b)


def test_parallel_names_the_same_bad_line_and_leaves_nothing(days, tmp_path):
    bad = tmp_path / "day_2"
    lines = days[2].read_bytes().split(b"\n")
    lines[555] = lines[555].replace(b"\t", b"\tzz", 1)
    bad.write_bytes(b"\n".join(lines))
    errors = []
    for workers, progress in ((1, None), (2, None), (2, lambda *a: None)):  # (a progress callback polls the units)
        with pytest.raises(ValueError) as info:
            preprocess_criteo_1tb([days[0], bad], tmp_path / "out", config=CFG, workers=workers, split_bytes=4000,
                                  progress=progress)
        errors.append(str(info.value))
    assert errors[0] == errors[1] == errors[2] and "line 556: field I1" in errors[0]
    assert sorted(os.listdir(tmp_path)) == ["day_2"]


def test_workers_validated_and_features_balanced(days, tmp_path):
    with pytest.raises(ValueError, match="workers=0"):
        preprocess_criteo_kaggle(days[0], tmp_path / "x", config=CFG, workers=0)
    groups = balance_features(CARDS, 3)
    assert sorted(f for g in groups for f in g) == list(range(26))
    loads = [sum(CARDS[f] for f in g) for g in groups]
    assert max(loads) <= min(loads) + max(CARDS)
