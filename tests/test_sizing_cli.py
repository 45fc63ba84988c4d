"""The sizing CLI as a newcomer meets it: raw id files (.npy / .npz / a directory) give the plan of the same ids
given as arrays, bad inputs exit with a message naming the file (no traceback), a budget range's curve is
monotone, equals an exhaustive split over directly simulated sizes and has its knee where the rule says, the
printed next step names a flag the recipe's parser accepts, and the PNG keeps small tables in one panel under
one legend."""
import argparse
import itertools
import json
import re

import numpy as np
import pytest

from cachedemb import sizing
from cachedemb.sizing import budgets, readers, report, simulators
from cachedemb.sizing.__main__ import main
from cachedemb.sizing.plan import TableSpec, parse_bytes
from cachedemb.tools.traces import zipf_trace

BATCH = 128
DIM = 8


@pytest.fixture(scope="module")
def ids():
    """Three tables' ids, one per sample: two Zipf tables and a 3-row one."""
    a = np.concatenate(zipf_trace(6000, BATCH, 20, 1.05, seed=1))
    b = np.concatenate(zipf_trace(2000, BATCH, 20, 0.8, seed=2))
    c = np.random.default_rng(0).integers(0, 3, a.size)
    return {"a": a, "b": b, "c": c}


def _as_batches(ids):
    return {n: [v[k:k + BATCH] for k in range(0, v.size, BATCH)] for n, v in ids.items()}


def _plan(source, **kw):
    return sizing.plan(source, 60_000, embedding_dim=DIM, batch_size=BATCH, points=8, refine=2, **kw)


def test_raw_npy_npz_and_directory_give_the_plan_of_the_same_arrays(ids, tmp_path):
    tables = [TableSpec(n, int(v.max()) + 1, DIM) for n, v in ids.items()]
    want = sizing.plan(_as_batches(ids), 60_000, tables, batch_size=BATCH, points=8, refine=2)
    np.savez(tmp_path / "ids.npz", **ids)
    (tmp_path / "dir").mkdir()
    for n, v in ids.items():
        np.save(tmp_path / "dir" / f"{n}.npy", v)
    np.save(tmp_path / "wide.npy", np.stack([ids["a"], ids["b"], ids["c"]], axis=1))  # [samples, tables]
    for source, names in ((tmp_path / "ids.npz", "abc"), (str(tmp_path / "dir"), "abc"),
                          (tmp_path / "wide.npy", ["wide_0", "wide_1", "wide_2"])):
        got = _plan(source)
        assert [t.spec.num_embeddings for t in got.tables] == [t.num_embeddings for t in tables]
        assert list(got.cache_rows.values()) == list(want.cache_rows.values()), source
        assert list(got.cache_rows) == list(names)
        assert got.pcie_bytes_per_step == pytest.approx(want.pcie_bytes_per_step)
    # a single .npy is one table named by its stem; rows given for it are used
    one = readers.IdFiles(tmp_path / "dir" / "a.npy", num_rows=10_000)
    assert one.table_names == ["a"] and one.table_sizes == [10_000] and one.rows_given == {"a": True}
    assert [b["a"].tolist() for b in one.batches(BATCH)] == [b.tolist() for b in _as_batches(ids)["a"]]
    mixed = readers.IdFiles(tmp_path / "ids.npz", num_rows={"b": 5000})
    assert mixed.table_sizes == [int(ids["a"].max()) + 1, 5000, 3]
    assert mixed.rows_given == {"a": False, "b": True, "c": False}


def test_recipe_sparse_file_as_raw_ids_equals_the_recipe_directory(data_dir):
    """The recipe's own train_sparse.npy read as raw ids (file order, rows from the metadata) sizes as the
    recipe directory read unshuffled without its warm start."""
    data = readers.DataDir(data_dir)
    kw = dict(batch_size=256, limit_batches=4, points=5, refine=0, id_freq=None, embedding_dim=data.embedding_dim)
    want = sizing.plan(data, 256 << 10, shuffle=False, **kw)
    raw = readers.IdFiles(data_dir / "train_sparse.npy",
                          num_rows={f"train_sparse_{j}": s for j, s in enumerate(data.table_sizes)})
    got = sizing.plan(raw, 256 << 10, **kw)
    assert list(got.cache_rows.values()) == list(want.cache_rows.values())
    assert got.hit_rate == pytest.approx(want.hit_rate)


@pytest.mark.parametrize("case, message", [
    ("floats.npy", r"floats\.npy'?: ids must be integers .* got dtype float32"),
    ("negative.npy", r"negative\.npy'?: table 'negative' has id -3; expected non-negative"),
    ("cube.npy", r"cube\.npy'?: shape \(8, 2, 2\); expected \[samples\] .* or \[samples, tables\]"),
    ("wide.npy", r"wide\.npy'?: shape \(2, 10\).*more tables than samples: transpose it"),
    ("empty", r"empty'? holds no \.npy or \.npz files"),
    ("nowhere.npy", r"nowhere\.npy'? not found; expected a \.npy or \.npz"),
    ("notes.txt", r"notes\.txt'?: expected a \.npy or \.npz .* got a \.txt file"),
    ("uneven", r"every table needs the same number of samples"),
    ("nodim", r"do not record the embedding dim: pass --embedding-dim"),
    ("rows", r"ok\.npy'?: table 'ok' has id 9, outside its 5 rows"),
    ("badrows", r"--num-rows 'x=y': expected a number"),
    ("budget", r"--budget: budget '1MiB:1KiB': a range needs 0 < LO < HI"),
])
def test_bad_inputs_exit_with_a_message_naming_them(tmp_path, capsys, case, message):
    np.save(tmp_path / "floats.npy", np.arange(8, dtype=np.float32))
    np.save(tmp_path / "negative.npy", np.array([1, 2, -3]))
    np.save(tmp_path / "cube.npy", np.zeros((8, 2, 2), dtype=np.int64))
    np.save(tmp_path / "wide.npy", np.zeros((2, 10), dtype=np.int64))
    np.save(tmp_path / "ok.npy", np.arange(10))
    (tmp_path / "notes.txt").write_text("1 2 3\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "uneven").mkdir()
    np.save(tmp_path / "uneven" / "x.npy", np.arange(10))
    np.save(tmp_path / "uneven" / "y.npy", np.arange(12))
    data = {"nodim": "ok.npy", "rows": "ok.npy", "badrows": "ok.npy", "budget": "ok.npy"}.get(case, case)
    argv = ["--data", str(tmp_path / data), "--budget", "1MiB", "--batch-size", "4"]
    argv += [] if case == "nodim" else ["--embedding-dim", "4"]
    argv += {"rows": ["--num-rows", "5"], "badrows": ["--num-rows", "x=y"],
             "budget": ["--budget", "1MiB:1KiB"]}.get(case, [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("python -m cachedemb.sizing: error: ")
    assert re.search(message, err), err


def test_parse_budgets():
    assert budgets.parse_budgets("8GiB") == [8 << 30]
    assert budgets.parse_budgets("1MiB:8MiB") == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert budgets.parse_budgets("1MiB:5MiB") == [1 << 20, 2 << 20, 4 << 20, 5 << 20]  # HI closes the range
    three = budgets.parse_budgets("1KiB:1MiB:3")
    assert three == [1024, 32768, 1 << 20]
    assert budgets.parse_budgets("4MB, 1MB,4MB") == [10**6, 4 * 10**6]
    for bad, match in (("1MiB:1KiB", "0 < LO < HI"), ("1MiB:2MiB:1", r"N must be an integer in \[2, 64\]"),
                       ("1MiB:2MiB:x", "N must be"), ("1:2:3:4", "LO:HI"),
                       (",".join(str(k) for k in range(1, 66)), "gives 65 budgets; at most 64"),
                       ("1MiB,2MiB:3MiB", "not a mix"), ("lots", "not a byte size")):
        with pytest.raises(ValueError, match=match):
            budgets.parse_budgets(bad)


def _brute_knee(x, y):
    """The rule written out point by point: perpendicular distance below the chord in scaled coordinates."""
    lx = [np.log2(v) for v in x]
    u = [(v - lx[0]) / (lx[-1] - lx[0]) for v in lx]
    v = [(w - min(y)) / (max(y) - min(y)) for w in y]
    (x0, y0), (x1, y1) = (u[0], v[0]), (u[-1], v[-1])
    best, where = 0.0, None
    for k in range(1, len(u) - 1):
        cross = (x1 - x0) * (v[k] - y0) - (y1 - y0) * (u[k] - x0)  # < 0: below the chord of a falling curve
        dist = -cross / np.hypot(x1 - x0, y1 - y0)
        if dist > best + 1e-12:
            best, where = dist, k
    return where


def test_knee_is_the_point_farthest_below_the_chord():
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(3, 12))
        x = np.sort(rng.choice(np.arange(1, 40), size=n, replace=False)).astype(float) ** 2
        y = np.sort(rng.random(n))[::-1] * 1000
        assert budgets.knee_index(x, y) == _brute_knee(x, y)
    assert budgets.knee_index([1, 2], [5, 1]) is None  # two points: no bend
    assert budgets.knee_index([1, 2, 4], [3, 3, 3]) is None  # flat
    assert budgets.knee_index([1, 2, 4], [9, 8, 1]) is None  # falls faster at the top: above the chord
    assert budgets.knee_index([1, 2, 4, 8], [9, 2, 1, 1]) == 1


def test_budget_range_is_monotone_and_each_point_is_the_best_split(ids):
    """Per-table caches (groups=None): each budget's bytes moved equal an exhaustive search over the curves'
    sizes with every size simulated directly; the curve falls, the hit rate rises, the knee follows the rule."""
    batches = _as_batches({"a": ids["a"], "b": ids["b"]})
    tables = [TableSpec(n, int(ids[n].max()) + 1, DIM) for n in ("a", "b")]
    curve = sizing.plan_range(batches, "2KB:1MB", tables, groups=None, points=6, refine=2, min_rows=1,
                              compare=("opt",))
    assert curve.too_small == [] and len(curve.points) == 10 and curve.whole_bytes < 1_000_000
    pcie = [p.pcie_bytes_per_step for p in curve.points]
    assert all(b <= a + 1e-9 for a, b in zip(pcie, pcie[1:])) and pcie[-1] < pcie[0]
    hits = [p.hit_rate for p in curve.points]
    assert all(b >= a - 1e-12 for a, b in zip(hits, hits[1:]))
    simulated = {}
    for p, point in zip(curve.plans, curve.points):
        options = []
        for t in p.tables:
            sizes = [int(s) for s in t.curve.sizes if s >= 1]
            for s in sizes:
                if (t.name, s) not in simulated:
                    simulated[t.name, s] = simulators.simulate_lfu(batches[t.name], s).rows_moved
            moved = [simulated[t.name, s] / t.curve.num_batches * t.spec.transfer_bytes for s in sizes]
            options.append([(s * t.spec.device_row_bytes, m) for s, m in zip(sizes, moved)])
        best = min(sum(m for _, m in pick) for pick in itertools.product(*options)
                   if sum(c for c, _ in pick) <= point.budget_bytes)
        assert point.pcie_bytes_per_step == pytest.approx(best, rel=1e-9)
        assert point.shared_pcie_bytes_per_step == pytest.approx(point.pcie_bytes_per_step)  # one table a cache
    assert curve.knee == _brute_knee([p.budget_bytes for p in curve.points], pcie) is not None
    assert set(curve.chosen_plan.tables[0].curves) == {"lfu", "opt"}  # compare: the chosen plan's only
    assert set(curve.plans[0].tables[0].curves) == {"lfu"} or curve.chosen == 0
    with pytest.raises(ValueError, match="every budget .* is below the smallest caches"):
        sizing.plan_range(batches, [10, 20], tables, points=4)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from cachedemb.recipes.dlrm.data import preprocess_criteo_kaggle, synthetic_criteo, write_criteo_tsv

    root = tmp_path_factory.mktemp("sizing_cli_data")
    config = synthetic_criteo(scale=1 / 400, min_large=300, embedding_dim=4)
    write_criteo_tsv(root / "train.txt", 3000, config.table_sizes, seed=0)
    return preprocess_criteo_kaggle(root / "train.txt", root / "preprocessed", config=config, train_fraction=0.9,
                                    val_fraction=0.1)


def _recipe_parser():
    """The DLRM recipe's argparse parser, caught as its parse_args runs (its other checks do not matter)."""
    from cachedemb.recipes.dlrm import main as recipe

    caught = []

    class Caught(Exception):
        pass

    def grab(self, *a, **k):
        caught.append(self)
        raise Caught

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab
    try:
        recipe.parse_args([])
    except Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
    assert caught, "the recipe's parse_args built no ArgumentParser"
    return caught[0]


def test_cli_on_a_recipe_directory_prints_plain_words_and_a_flag_the_recipe_accepts(data_dir, tmp_path, capsys):
    report_ = main(["--data", str(data_dir), "--budget", "320KiB", "--batch-size", "256", "--limit-batches", "4",
                    "--points", "4", "--compare", "", "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    for jargon in ("objective", "bound ", "optimal", "node limit"):
        assert jargon not in out
    assert "split found: " in out and "of predicted misses per step" in out
    assert "rows per table from its metadata.json" in out
    line = next(s for s in out.splitlines() if "DLRM recipe:" in s)
    flag, value = line.split()[-2:]
    assert flag in _recipe_parser()._option_string_actions
    assert parse_bytes(value) == 320 << 10 == report_["next_step"]["budget_bytes"]
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["budget_bytes"] == 320 << 10 and len(saved["tables"]) == 26  # the plan's JSON as before
    assert saved["next_step"]["cache_rows"] == {t["table"]: t["cache_rows"] for t in saved["tables"]}


def test_cli_range_on_raw_ids_prints_the_curve_the_knee_and_the_code(ids, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    np.savez(tmp_path / "ids.npz", **ids)
    rep = main(["--data", str(tmp_path / "ids.npz"), "--embedding-dim", str(DIM), "--batch-size", str(BATCH),
                "--budget", "4KiB:256KiB", "--points", "6", "--compare", "opt", "--num-rows", "a=6000",
                "--png", str(tmp_path / "range.png"), "--json", str(tmp_path / "range.json")])
    out = capsys.readouterr().out
    assert "given by --num-rows for a, max id + 1 (inferred) for the rest" in out
    assert "budget range" in out and "<- knee" in out and "knee: " in out
    assert "left out, below the smallest caches" in out  # 4KiB cannot hold a batch of each table
    chosen = rep["chosen_budget_bytes"]
    assert rep["knee"] == chosen and rep["plan"]["budget_bytes"] == chosen
    assert f"cache_rows={json.dumps(rep['next_step']['cache_rows'])}" in out
    assert "DLRM recipe" not in out and "cachedemb.sizing.IdFiles(" in out
    pcie = [p["pcie_bytes_per_step"] for p in rep["budgets"]]
    assert pcie == sorted(pcie, reverse=True)
    assert (tmp_path / "range.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_puts_small_tables_in_one_panel_under_one_legend(ids, tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    p = _plan(_as_batches(ids), compare=("opt",))
    big, small = report._panels(p)
    assert [t.name for t in small] == ["c"] and {t.name for t in big} == {"a", "b"}  # the 3-row table
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    p.plot(tmp_path / "p.png")
    (fig,) = figures
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 3 and titles[-1].startswith("other: 1 small table\n")
    assert fig.get_layout_engine() is not None  # constrained layout: no gap under the title


def test_png_without_matplotlib_is_refused_before_any_work(ids, tmp_path, capsys, monkeypatch):
    """A user without matplotlib asking for --png gets an argparse error naming the fix, not a traceback after the
    simulations."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(sizing.plan_module if hasattr(sizing, "plan_module") else sizing, "plan",
                        lambda *a, **k: pytest.fail("planned before refusing --png"), raising=False)
    with pytest.raises(SystemExit) as done:
        main(["--data", str(ids), "--embedding-dim", "8", "--budget", "64KiB", "--png", str(tmp_path / "x.png")])
    assert done.value.code == 2
    assert "--png" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
