"""The sizing plan, its readers and outputs: traces from every input form, a group's cache = its tables' rows
summed (predicted by simulating that shared cache), byte accounting against the real cache, the CLI, the text
table / JSON / PNG, and torchrec's CacheStatistics."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import cachedemb
from cachedemb import sizing
from cachedemb.sizing import readers, shards, simulators
from cachedemb.sizing.plan import SLOT_METADATA_BYTES, TableSpec, parse_bytes, plan, read_traces
from cachedemb.tools.traces import zipf_trace

BATCHES = 30


@pytest.fixture(scope="module")
def three_tables():
    """Tables a and b share a cache in a collection (dim 8), c is alone (dim 16)."""
    traces = {"a": zipf_trace(20_000, 512, BATCHES, 1.05, seed=1), "b": zipf_trace(8_000, 512, BATCHES, 0.8, seed=2),
              "c": zipf_trace(12_000, 512, BATCHES, 1.2, seed=3)}
    tables = [cachedemb.TableConfig("a", 20_000, 8, ["fa"]), cachedemb.TableConfig("b", 8_000, 8, ["fb"]),
              cachedemb.TableConfig("c", 12_000, 16, ["fc"])]
    return traces, tables


@pytest.fixture(scope="module")
def three_plan(three_tables):
    traces, tables = three_tables
    return plan(traces, 200_000, tables, optimizer=cachedemb.optim.RowWiseAdagrad(0.1), compare=("opt",),
                points=12, refine=4)


def test_plan_respects_the_budget_and_maps_groups(three_tables, three_plan):
    traces, tables = three_tables
    p = three_plan
    assert set(p.cache_rows) == {"a", "b", "c"} and p.budget_used <= 200_000
    assert p.budget_used == sum(p.cache_rows[t.name] * (t.embedding_dim * 4 + 4 + SLOT_METADATA_BYTES) for t in tables)
    assert [g.tables for g in p.groups] == [("a", "b"), ("c",)]
    # a group's cache holds its tables' rows summed; its prediction is that shared cache, simulated directly
    shared = p.groups[0]
    assert shared.cache_rows == p.cache_rows["a"] + p.cache_rows["b"]
    merged = [np.concatenate([a, b + 20_000]) for a, b in zip(traces["a"], traces["b"])]
    direct = simulators.simulate_lfu(merged, shared.cache_rows)
    assert shared.rows_per_batch == pytest.approx(direct.rows_moved / BATCHES)
    assert shared.miss_ratio == pytest.approx(direct.rows_moved / direct.unique_lookups)
    # a lone table's cache is its own curve at its rows
    c = p.table("c")
    assert p.groups[1].rows_per_batch == pytest.approx(c.rows_per_batch)
    assert c.rows_per_batch == pytest.approx(simulators.simulate_lfu(traces["c"], c.cache_rows).rows_moved / BATCHES)
    assert c.pcie_bytes_per_step == pytest.approx(c.rows_per_batch * (16 * 4 + 4 + 8))
    assert p.pcie_bytes_per_step == pytest.approx(sum(g.pcie_bytes_per_step for g in p.groups))
    assert set(c.curves) == {"lfu", "opt"}
    for name, t in traces.items():  # each cache holds at least its largest batch's distinct ids
        assert p.cache_rows[name] >= max(np.unique(b).size for b in t)
    assert np.all(c.curves["opt"].rows_moved <= c.curves["lfu"].rows_moved)  # Belady is the floor


def test_per_table_caches_and_host_tier(three_tables):
    traces, tables = three_tables
    p = plan(traces, 200_000, tables, groups=None, host_budget_bytes=600_000, points=10, refine=0)
    assert [g.tables for g in p.groups] == [("a",), ("b",), ("c",)]
    assert all(t.host_rows >= t.cache_rows for t in p.tables)
    assert sum(t.host_rows * t.spec.host_row_bytes for t in p.tables) <= 600_000
    assert all(t.file_bytes_per_step <= t.pcie_bytes_per_step + 1e-9 for t in p.tables)
    explicit = plan(traces, 200_000, tables, groups=[["a"], ["b", "c"]], points=10, refine=0)
    assert [g.tables for g in explicit.groups] == [("a",), ("b", "c")]


def test_slot_metadata_bound_holds_for_the_real_cache():
    """SLOT_METADATA_BYTES is an upper bound on the cache's per-row device metadata (and not far above it):
    if the cache's layout changes, this says so."""
    for opt in (None, cachedemb.optim.RowWiseAdagrad(0.1), cachedemb.optim.Adam()):
        spec = TableSpec("t", 20_000, 16, state_cols=sizing.state_cols(opt, 16))
        for rows in (10, 1000, 1025, 4096, 20_000):
            cache = cachedemb.CachedEmbeddingBag(20_000, 16, cache_rows=rows, optimizer=opt).cache
            held = cache.device_bytes() + rows * 8  # + a victim pool at its largest (one slot per row)
            assert held <= rows * spec.device_row_bytes + 512, (opt, rows)
            assert held >= rows * (spec.device_row_bytes - 24), (opt, rows)


def test_table_spec_bytes():
    s = TableSpec.from_config(cachedemb.TableConfig("t", 10, 32, dtype=torch.float16), cachedemb.optim.Adam())
    assert (s.row_bytes, s.state_bytes, s.transfer_bytes) == (64, 2 * 32 * 4, 64 + 256 + 8)
    d = TableSpec("d", 10, 4, torch.float64, state_cols=1)
    assert (d.row_bytes, d.state_bytes, d.device_row_bytes) == (32, 8, 40 + SLOT_METADATA_BYTES)
    torchrec = pytest.importorskip("torchrec")
    cfg = torchrec.EmbeddingBagConfig(name="e", num_embeddings=7, embedding_dim=8, feature_names=["x"],
                                      data_type=torchrec.types.DataType.BF16)
    e = TableSpec.from_config(cfg)
    assert (e.dtype, e.feature_names, e.row_bytes) == (torch.bfloat16, ("x",), 16)


# ------------------------------------------------------------------------------------------------- readers


def test_readers_take_every_input_form():
    tables = [TableSpec("t1", 100, 4, feature_names=("f1", "f2")), TableSpec("t2", 100, 4, feature_names=("f2",))]
    f1, f2 = torch.tensor([1, 2, 3]), torch.tensor([7, 8])
    want = {"t1": [1, 2, 3, 7, 8], "t2": [7, 8]}
    feats = readers.feature_tables(tables)
    as_dict = readers.batch_ids({"f1": (f1, torch.tensor([0, 1, 3])), "f2": (f2, torch.tensor([0, 1, 2])),
                                 "unused": (torch.tensor([5]), torch.tensor([0, 1]))}, feats)
    assert {k: v.tolist() for k, v in as_dict.items()} == want
    dense = readers.batch_ids(torch.tensor([[1, 7], [2, 8]]), feats)
    assert {k: v.tolist() for k, v in dense.items()} == {"t1": [1, 2, 7, 8], "t2": [7, 8]}
    one = readers.batch_ids((torch.tensor([[4, 5], [6, 4]]), None), None)
    assert one["table"].tolist() == [4, 5, 6, 4]
    with pytest.raises(ValueError, match="feeds one table"):
        readers.batch_ids((f1, torch.tensor([0, 3])), feats)
    with pytest.raises(ValueError, match=r"missing feature\(s\) \['f2'\]"):
        readers.batch_ids({"f1": (f1, torch.tensor([0, 3]))}, feats)
    with pytest.raises(ValueError, match="2-D"):
        readers.batch_ids(torch.tensor([[1, 2, 3]]), feats)
    with pytest.raises(ValueError, match="integer"):
        readers.batch_ids({"f1": (torch.tensor([1.5]), None), "f2": (f2, None)}, feats)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        readers.batch_ids("ids", feats)
    with pytest.raises(ValueError, match="batch 1 has tables"):
        readers.collect([{"a": np.array([1])}, {"b": np.array([1])}])


def test_reader_takes_keyed_jagged_tensors():
    torchrec = pytest.importorskip("torchrec")
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 7, 8]), lengths=torch.tensor([1, 2, 1, 1]))
    tables = [TableSpec("t1", 100, 4, feature_names=("f1", "f2")), TableSpec("t2", 100, 4, feature_names=("f2",))]
    traces = read_traces([kjt, kjt], tables)
    assert traces["t1"].uniq[0].tolist() == [1, 2, 3, 7, 8] and traces["t2"].counts[1].tolist() == [1, 1]
    assert traces["t1"].lookups == 10 and traces["t1"].unique_per_batch.tolist() == [5, 5]


def test_read_traces_from_arrays_and_sampling():
    a = zipf_trace(5000, 200, 10, 1.0, seed=0)
    t = read_traces({"x": a, "y": np.stack(a)})
    assert [u.tolist() for u in t["x"].uniq] == [u.tolist() for u in t["y"].uniq]
    assert read_traces(a)["table"].lookups == 2000
    sampled = read_traces({"x": a}, sample_rate=0.5, salt=3)["x"]
    assert sampled.rate == pytest.approx(0.5) and sampled.unique_per_batch.tolist() == t["x"].unique_per_batch.tolist()
    with pytest.raises(ValueError, match="same number of batches"):
        read_traces({"x": a, "y": a[:3]})
    with pytest.raises(ValueError, match="max_unique"):
        read_traces(a, max_unique="big")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from cachedemb.recipes.dlrm.data import preprocess_criteo_kaggle, synthetic_criteo, write_criteo_tsv

    root = tmp_path_factory.mktemp("sizing_data")
    config = synthetic_criteo(scale=1 / 400, min_large=300, embedding_dim=4)
    write_criteo_tsv(root / "train.txt", 4000, config.table_sizes, seed=0)
    return preprocess_criteo_kaggle(root / "train.txt", root / "preprocessed", config=config, train_fraction=0.9,
                                    val_fraction=0.1)


def test_data_dir_reads_batches_in_the_recipes_order(data_dir):
    from cachedemb.recipes.dlrm.data import PreprocessedSplit, load_id_freq

    split = PreprocessedSplit(data_dir, "train")
    data = readers.DataDir(data_dir)
    assert data.table_names == [f"t_{c}" for c in split.metadata["cat_names"]]
    for kw in ({"shuffle": True, "seed": 3, "epoch": 1, "limit_batches": 5}, {"shuffle": False}):
        ours = list(data.batches(256, **kw))
        theirs = list(split.batches(256, **kw))
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            assert all(a[n].tolist() == b.sparse[:, j].tolist() for j, n in enumerate(data.table_names))
    freq = data.id_freq()
    assert all(freq[n].tolist() == f.tolist() for n, f in zip(data.table_names, load_id_freq(data_dir)))
    assert readers.DataDir(data_dir.parent).path == data_dir  # the parent of `preprocessed` works too
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        readers.DataDir(data_dir / "nowhere")


# ------------------------------------------------------------------------------------- outputs and the CLI


def test_cli_prints_writes_json_and_draws(data_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from cachedemb.sizing.__main__ import main

    report = main(["--data", str(data_dir), "--budget", "512KiB", "--batch-size", "256", "--points", "6",
                   "--limit-batches", "6",
                   "--compare", "lru,opt", "--json", str(tmp_path / "plan.json"), "--png", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert "t_C1" in out and "predicted: hit rate" in out and "shared caches" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["budget_bytes"] == 524288 and saved["budget_used"] <= 524288 == report["budget_bytes"]
    assert len(saved["tables"]) == 26 and set(saved["tables"][0]["curves"]) == {"lfu", "lru", "opt"}
    assert saved["options"]["warmup_ratio"] == 0.7  # the recipe's warm start, from the data's train counts
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    la = main(["--data", str(data_dir), "--budget", "512KiB", "--batch-size", "256", "--points", "4", "--compare", "",
               "--limit-batches", "6",
               "--policy", "lookahead", "--depth", "2", "--horizon", "4", "--json", "-"])
    assert la["policy"] == "lookahead" and la["options"] == {"horizon": 4, "depth": 2, "overlap": True,
                                                             "warmup_ratio": 0.7}
    with pytest.raises(SystemExit):
        main(["--data", str(data_dir), "--budget", "512KiB", "--compare", "fifo"])


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("1.5 MB") == 1_500_000 and parse_bytes(1024) == 1024
    assert parse_bytes("512kib") == 512 << 10 and parse_bytes("100") == 100
    for bad in ("8 furlongs", "-1GB", "GB", "nan"):
        with pytest.raises(ValueError, match="not a byte size"):
            parse_bytes(bad)


def test_plan_errors(three_tables):
    traces, tables = three_tables
    with pytest.raises(ValueError, match="budget of 100 bytes is below.*pass min_rows=1"):
        plan(traces, 100, tables, points=4, refine=0)
    small = plan(traces, 30_000, tables, points=6, refine=0, min_rows=1)  # under a batch per table: allowed
    assert small.budget_used <= 30_000 and min(small.cache_rows.values()) >= 1
    with pytest.raises(ValueError, match="min_rows must be"):
        plan(traces, 10**6, tables, min_rows=0, points=4)
    with pytest.raises(ValueError, match="policy 'fifo'"):
        plan(traces, 10**6, tables, policy="fifo")
    with pytest.raises(ValueError, match=r"no trace for table\(s\) \['d'\]"):
        plan(traces, 10**6, tables + [cachedemb.TableConfig("d", 10, 8)], points=4)
    with pytest.raises(ValueError, match="embedding_dim="):
        plan(traces, 10**6, points=4)
    with pytest.raises(ValueError, match="id_freq names unknown tables"):
        plan(traces, 10**6, tables, id_freq={"zz": np.ones(3, dtype=np.int64)}, points=4)
    with pytest.raises(ValueError, match="every table exactly once"):
        plan(traces, 10**6, tables, groups=[["a"], ["b"]], points=4)


def test_outputs_are_readable(three_plan, tmp_path):
    text = three_plan.format_table()
    assert all(name in text for name in ("a", "b", "c")) and "split found: " in text
    json.dumps(three_plan.to_dict())
    if pytest.importorskip("matplotlib"):
        assert three_plan.plot(tmp_path / "p.png").stat().st_size > 1000


def test_torchrec_cache_statistics(three_plan):
    stats = three_plan.cache_statistics("c")
    curve = three_plan.table("c").curve
    assert stats.expected_lookups == pytest.approx(curve.unique_lookups / BATCHES)
    assert stats.expected_miss_rate(0) == 1.0 and stats.expected_miss_rate(1.0) == 0.0
    assert stats.expected_miss_rate(curve.sizes[3] / 12_000) == pytest.approx(curve.miss_ratio[3])
    # the area under the miss ratio over load factors 0..1, by a fine independent integration
    x = np.linspace(0, 1, 200_001)
    area = np.mean(np.interp(x * 12_000, curve.sizes, curve.miss_ratio))
    assert stats.cacheability == pytest.approx(area, abs=1e-3)
    torchrec_types = pytest.importorskip("torchrec.distributed.types")
    assert isinstance(stats, torchrec_types.CacheStatistics)
    params = torchrec_types.CacheParams(algorithm=torchrec_types.CacheAlgorithm.LFU, load_factor=0.1, stats=stats)
    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer

    option = SimpleNamespace(cache_params=params)
    assert EmbeddingOffloadScaleupProposer.get_cacheability(option) == stats.cacheability
    assert EmbeddingOffloadScaleupProposer.get_expected_lookups(option) == stats.expected_lookups


def test_merged_trace_samples_each_table_by_its_own_ids():
    a = shards.table_trace(zipf_trace(3000, 300, 5, 1.0, seed=0), rate=0.5)
    b = shards.table_trace(zipf_trace(3000, 300, 5, 1.0, seed=1), rate=0.25)
    m = shards.merge([a, b], [0, 3000])
    assert m.rate == pytest.approx(0.25)
    lower_a = a.band(0, b.hi)
    for j in range(5):
        assert m.uniq[j].tolist() == lower_a.uniq[j].tolist() + (b.uniq[j] + 3000).tolist()
    assert m.keeps(m.uniq[0]).all() and m.unique_per_batch.tolist() == (a.unique_per_batch + b.unique_per_batch).tolist()
    with pytest.raises(ValueError, match="ascend"):
        shards.merge([a, b], [3000, 0])
