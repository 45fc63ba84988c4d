"""scripts/bench_prefetch.py on a tiny CPU shape: the JSON's structure (both modes per configuration, stage
seconds, launch counts), and the paired modules end with bit-identical tables. Never asserts on timing."""
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_prefetch.py"
TINY = ["--rows", "3000", "--dim", "8", "--bags", "16", "--bag-len", "4", "--ratios", "0.02", "0.2",
        "--depths", "1", "2", "--horizons", "4", "--warmup", "3", "--batches", "6"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_prefetch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_pairs_every_configuration_and_the_tables_agree(tmp_path, capsys):
    out = tmp_path / "prefetch.json"
    report = load_bench().main(TINY + ["--launch-bags", "0", "--machine", "test", "--out", str(out),
                                       "--trace-cache", str(tmp_path / "trace.npy")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["git"] and report["command"].startswith("python ") and report["machine"]["note"] == "test"
    runs = report["runs"]
    assert [(r["cache_ratio"], r["depth"], r["horizon"]) for r in runs] == [
        (0.02, 1, 4), (0.02, 2, 4), (0.2, 1, 4), (0.2, 2, 4)]
    for r in runs:
        assert r["tables_equal"], r
        assert r["steps"] == 6 and r["none"]["windows"] == 0
        assert set(r["prefetch_over_none"]) == {"step_ms", "step_ms_median", "thread_cpu_ms"}
        assert r["paired_ratio_median"] > 0
        # the same batches: the same distinct ids looked up by both
        assert r["none"]["unique_lookups"] == r["prefetch"]["unique_lookups"] > 0
        assert "lookup" in r["none"]["stage_ms_per_batch"]
        assert any(k.startswith("prefetch.") for k in r["prefetch"]["stage_ms_per_batch"])
        assert sum(r["prefetch"]["window_batches"].values()) >= 1
        # rows moved over Belady-OPT (per batch, or over the pipeline's windows): no policy moves fewer
        opt = r["rows_moved_over_opt"]
        assert opt["opt_rows_per_batch"] > 0 and opt["opt_rows_per_window"] > 0
        assert opt["none"] >= 1.0 and opt["prefetch"] >= 1.0, opt
    large = [r for r in runs if r["cache_ratio"] == 0.2 and r["depth"] == 2][0]
    assert large["prefetch"]["windows"] > 0  # 600 rows hold windows of these batches
    # a second run reads the same batches from the trace cache
    again = load_bench().main(TINY[:-4] + ["--warmup", "3", "--batches", "6", "--ratios", "0.2", "--depths", "2",
                                           "--launch-bags", "0", "--trace-cache", str(tmp_path / "trace.npy")])
    assert again["runs"][0]["none"]["rows_moved"] == large["none"]["rows_moved"]


def test_reports_launch_counts_with_and_without_prefetch():
    bench = load_bench()
    args = bench.argparse.Namespace(depths=[2], horizons=[4], launch_bags=8)
    counts = bench.launch_counts(args)["per_step"]
    assert [c["prefetch"] for c in counts] == [None, {"depth": 2, "horizon": 4}]
    assert all(c["launches"] > 0 for c in counts) and counts[1]["host_pipeline_ops"] > 0


def test_paired_ratio_is_taken_over_whole_windows():
    """At depth d one step in d admits the window: the ratio is taken over runs of d steps, so a window's step is
    never left out (a median of single steps would pick the steps without one)."""
    bench = load_bench()
    prefetch = [4.0, 1.0, 1.0, 1.0] * 5
    none = [2.0] * 20
    assert bench.paired_ratio_median(prefetch, none, 4) == 0.875
    assert bench.paired_ratio_median(prefetch, none, 1) == 0.5
