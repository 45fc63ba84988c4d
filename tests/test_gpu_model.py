"""scripts/gpu_model.py: the step model's calibration at abfc35d (constants from the H200 microbenchmarks only,
counts from the profile) and its shape: more bytes or launches cost more, overlap costs less. All on CPU."""
import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_model", ROOT / "scripts" / "gpu_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gm = _load()


@pytest.fixture(scope="module")
def calibration():
    return gm.calibration()


@pytest.mark.parametrize("step", ["in_memory", "no_prefetch", "prefetch"])
def test_abfc35d_steps_are_reproduced_within_tolerance(calibration, step):
    row = calibration["steps"][step]
    assert row["within"], (step, row["predicted_ms"], row["measured_ms"], row["error"])
    assert abs(row["predicted_ms"] / row["measured_ms"] - 1) <= gm.TOLERANCE


def test_the_abfc35d_prefetch_step_is_bound_by_the_host_read_ahead(calibration):
    """At abfc35d the read-ahead ran on a host thread: the next window's admission waited for its next-use query,
    which starts after this window's admission (the slot snapshot). The training thread alone is far shorter."""
    row = calibration["steps"]["prefetch"]["breakdown"]
    assert row["bound"] == "read_ahead_chain" and row["read_ahead"]["kind"] == "host"
    assert row["read_ahead"]["training_thread_ms"] < 0.5 * row["step_ms"]
    # the bench's 18 batches are all entered in the first fill (read-ahead distance 24): no enter in a timed step
    assert row["read_ahead"]["enters_before_timed_steps"]
    assert row["read_ahead"]["read_ahead_thread_ms"] == pytest.approx(row["read_ahead"]["query_ms_per_window"])


def test_the_host_read_ahead_constant_is_host_work_measured_on_a_cpu(tmp_path):
    """The query's rate is the read-ahead thread's own stage time: doubling it moves the prediction by about the
    query's time; the step figures do not enter it (test below)."""
    d = json.loads(gm.DEFAULT_STEPS[1].read_text())
    d["runs"][0]["cache_seconds"]["prefetch_next_use_query"] *= 2
    path = tmp_path / "prefetch.json"
    path.write_text(json.dumps(d))
    a = gm.calibration()["steps"]["prefetch"]
    b = gm.calibration(steps=[gm.DEFAULT_STEPS[0], path])["steps"]["prefetch"]
    q = a["breakdown"]["read_ahead"]["query_ms_per_window"]
    assert b["predicted_ms"] - a["predicted_ms"] == pytest.approx(q)
    assert b["measured_ms"] == a["measured_ms"]


def test_constants_come_from_the_microbenchmarks_not_from_the_steps(tmp_path):
    """Rewriting the measured step times changes the errors, never the predictions."""
    steps = [json.loads(p.read_text()) for p in gm.DEFAULT_STEPS]
    paths = []
    for i, d in enumerate(steps):
        d = copy.deepcopy(d)
        d["runs"][0]["cached_step_s"] *= 3
        d["runs"][0]["reference_step_s"] = (d["runs"][0].get("reference_step_s") or 1.0) * 3
        paths.append(tmp_path / f"step{i}.json")
        paths[-1].write_text(json.dumps(d))
    a = gm.calibration()
    b = gm.calibration(steps=paths)
    assert set(a["steps"]) == {"in_memory", "no_prefetch", "prefetch"}
    for k in a["steps"]:
        assert a["steps"][k]["predicted_ms"] == b["steps"][k]["predicted_ms"]
        assert a["steps"][k]["measured_ms"] != b["steps"][k]["measured_ms"]
    assert a["prefetch_at_this_cpus_rates"]["predicted_ms"] == b["prefetch_at_this_cpus_rates"]["predicted_ms"]
    assert a["constants"]["source"]["kernels"] == gm.DEFAULT_KERNELS.name


@pytest.fixture(scope="module")
def consts():
    return gm.load_constants(gm.DEFAULT_KERNELS)


def step(move_bytes=50e6, launches=40, side=False, host_reads=0):
    ev = [{"kind": "copy", "bytes": 3.4e6, "pinned": False}]
    ev += [{"kind": "launch", "bytes": 1e5} for _ in range(launches)]
    ev.append({"kind": "row_move", "in_bytes": move_bytes / 2, "out_bytes": move_bytes / 2,
               "stream": "side" if side else "compute"})
    ev += [{"kind": "host_read"} for _ in range(host_reads)]
    ev.append({"kind": "launch", "bytes": 2e8, "rate": "backward_update"})
    if side:
        ev.append({"kind": "wait", "stream": "compute", "on": "side"})
    return ev


def test_more_bytes_take_more_time(consts):
    times = [gm.simulate(step(move_bytes=b), consts)["step_ms"] for b in (0, 10e6, 50e6, 200e6)]
    assert times == sorted(times) and times[0] < times[-1]


def test_more_launches_take_more_time(consts):
    times = [gm.simulate(step(launches=n), consts)["step_ms"] for n in (0, 20, 80)]
    assert times == sorted(times) and times[0] < times[-1]


def test_a_move_on_a_side_stream_overlaps_compute(consts):
    serial = gm.simulate(step(), consts)
    overlapped = gm.simulate(step(side=True), consts)
    assert overlapped["step_ms"] < serial["step_ms"]
    assert overlapped["device_busy_ms"]["side"] == pytest.approx(serial["row_move_ms"])


def test_a_host_read_waits_for_the_device(consts):
    free = gm.simulate(step(), consts)
    read = gm.simulate(step(host_reads=1), consts)
    assert read["host_wait_ms"] > 0 and read["step_ms"] >= free["step_ms"]


def test_a_record_becomes_a_timeline_at_the_bench_shape(consts):
    """A CPU record (two row-move launches: out, then in) carried to the bench shape: rows moved are the misses
    both ways, the other launches keep their count."""
    record = {"lookups_per_step": 1664.0, "rows_in_per_step": 500.0, "rows_out_per_step": 450.0,
              "argument_bytes_per_step": {"compute": 1e6}, "host_reads_per_step": {},
              "events": [{"kind": "launch", "engine": "triton", "name": "unique_heads_kernel", "stream": "compute",
                          "bytes": 1000},
                         {"kind": "launch", "engine": "aten", "name": "empty.memory_format", "stream": "compute",
                          "bytes": 0},
                         {"kind": "row_move", "engine": "triton", "name": "row_stream_kernel", "stream": "compute",
                          "bytes": 0, "direction": "out"},
                         {"kind": "row_move", "engine": "triton", "name": "row_stream_kernel", "stream": "compute",
                          "bytes": 0, "direction": "in"},
                         {"kind": "launch", "engine": "triton", "name": "pooled_forward_kernel",
                          "stream": "compute", "bytes": 0}]}
    s = gm.Shape()
    ev = gm.cached_events_from_record(s, record, unique=135000, hit_rate=0.3)
    moves = [e for e in ev if e["kind"] == "row_move"]
    misses = 135000 * 0.7
    assert [m["out_bytes"] for m in moves] == [pytest.approx(misses * 256), 0]
    assert [m["in_bytes"] for m in moves] == [0, pytest.approx(misses * 256)]
    small = next(e for e in ev if e["name"] == "unique_heads_kernel")
    assert small["bytes"] == pytest.approx(1000 * s.lookups / 1664)
    assert not next(e for e in ev if e["name"] == "empty.memory_format")["runtime_call"]
    assert [e["name"] for e in ev[:2]] == ["ids", "offsets"]  # the caller's pageable copies open the step
    out = gm.simulate(ev, consts)
    assert out["row_move_ms"] == pytest.approx(2 * misses * 256 / consts.zero_copy * 1e3)


def _train(step_ms, host_s, device_s):
    return {"step_ms": step_ms, "marks": [{"name": "snapshot", "host_s": host_s, "device_s": device_s}]}


def test_the_read_ahead_bounds_the_step_only_when_it_is_the_longest():
    s = gm.Shape()
    ra = gm.HostReadAhead(enter_s_per_lookup=1e-9, query_s_per_slot=50e-9, query_waits_snapshot=False,
                          batches_per_window=1.0, source="test")
    slow = gm.with_host_read_ahead(_train(6.0, 0.003, 0.005), ra, s, 200_000, trace_batches=18, depth=4)
    assert slow["bound"] == "read_ahead_chain"  # the query (10 ms) starts when the device has the snapshot
    assert slow["step_ms"] == pytest.approx(5.0 + 10.0)
    waits = gm.HostReadAhead(**{**vars(ra), "query_waits_snapshot": True})  # its time already holds the wait
    assert gm.with_host_read_ahead(_train(6.0, 0.003, 0.005), waits, s, 200_000, 18, 4)["step_ms"] == \
        pytest.approx(3.0 + 10.0)
    fast = gm.HostReadAhead(**{**vars(ra), "query_s_per_slot": 1e-9})
    assert gm.with_host_read_ahead(_train(6.0, 0.003, 0.005), fast, s, 200_000, 18, 4)["bound"] == \
        "training_thread"
    # a stream longer than the read-ahead distance: every batch's enter is on the thread too
    busy = gm.HostReadAhead(**{**vars(ra), "enter_s_per_lookup": 20e-9})  # 8.5 ms a batch's enter
    assert gm.with_host_read_ahead(_train(6.0, 0.003, 0.005), busy, s, 200_000, 18, 4)["step_ms"] == \
        pytest.approx(15.0)  # the bench's 18 batches: entered before the timed steps
    endless = gm.with_host_read_ahead(_train(6.0, 0.003, 0.005), busy, s, 200_000, trace_batches=None, depth=4)
    assert endless["bound"] == "read_ahead_thread"
    assert endless["step_ms"] == pytest.approx(10.0 + s.lookups * 20e-9 * 1e3)
    # windows of two batches: one query per two steps
    two = gm.HostReadAhead(**{**vars(ra), "batches_per_window": 2.0})
    assert gm.with_host_read_ahead(_train(6.0, 0.003, 0.005), two, s, 200_000, 18, 4)["step_ms"] == \
        pytest.approx(7.5)


def test_the_current_tree_prefetch_runs_the_device_read_ahead_and_prints_the_ratios(tmp_path):
    """The committed prefetch record says which read-ahead a CUDA cache gets: the device one, so no host id work
    is on the critical path; the ratios of the bar are printed."""
    results = ROOT / "benchmarks" / "results"
    pre = json.loads((results / "step_record_cpu_prefetch4.json").read_text())
    assert pre["read_ahead"] == {"recorded": "host", "cuda_cache": "device"}
    out = tmp_path / "pred.json"
    report = gm.main(["--record", str(results / "step_record_cpu.json"), "--prefetch-record",
                      str(results / "step_record_cpu_prefetch4.json"), "--out", str(out)])
    cur = report["current_tree"]
    assert cur["prefetch"]["read_ahead"]["kind"] == "device" and not cur["prefetch"]["read_ahead"]["on_critical_path"]
    assert cur["ratios"]["prefetch/no_prefetch"] == pytest.approx(cur["prefetch"]["step_ms"] /
                                                                  cur["no_prefetch"]["step_ms"])
    assert set(cur["ratios"]) == {"prefetch/in_memory", "no_prefetch/in_memory", "prefetch/no_prefetch"}
    assert json.loads(out.read_text())["tree"]["commit"]
    # its sort a batch runs on the read-ahead's own stream, beside the step: the step is the one without it
    assert cur["prefetch"]["device_busy_ms"]["read_ahead"] > 0
    m = gm.measured_abfc35d()
    alone = gm.simulate(gm.cached_events_from_record(gm.Shape(), pre, m["unique_per_batch"], m["hit_rate"]),
                        gm.load_constants(gm.DEFAULT_KERNELS))
    assert cur["prefetch"]["step_ms"] == pytest.approx(alone["step_ms"])


def test_the_read_ahead_kind_follows_the_pipelines_rule(monkeypatch):
    from types import SimpleNamespace

    from cachedemb.tools.step_record import read_ahead_kinds

    cpu = SimpleNamespace(device=__import__("torch").device("cpu"))
    assert read_ahead_kinds(cpu) == {"recorded": "host", "cuda_cache": "device"}
    monkeypatch.setenv("CACHEDEMB_READ_AHEAD", "host")
    assert read_ahead_kinds(cpu) == {"recorded": "host", "cuda_cache": "host"}
    rec = {"read_ahead": read_ahead_kinds(cpu)}
    assert gm.read_ahead_kind(rec) == "host"


def test_the_host_read_ahead_bench_runs_the_pipelines_sequence(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("host_read_ahead_bench",
                                                  ROOT / "scripts" / "host_read_ahead_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.drive(rows=20_000, batch=64, pooling=26, alpha=1.05, cache_rows=600, depth=4, horizon=16, windows=3,
                    warmup_windows=1)
    assert r["windows"] == 3 and 1 <= r["batches_per_window"] <= 4
    assert r["enter_ns_per_lookup"] > 0 and r["query_ns_per_slot_id"] > 0
    assert r["read_ahead_ms_per_batch"] == pytest.approx(r["enter_ms_per_batch"] + r["query_ms_per_window"] *
                                                         r["windows"] / r["batches"])
    with pytest.raises(SystemExit):
        bench.main(["--merge", str(tmp_path / "out.json"), str(ROOT / "benchmarks" / "results" /
                                                                "step_record_cpu.json")])
    assert "not host_read_ahead_bench.py outputs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--windows", "0"])
    assert "--windows 0: expected a positive integer" in capsys.readouterr().err


def test_the_cli_refuses_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gm.main(["--record", str(tmp_path / "none.json")])
    assert e.value.code == 2 and "none.json: no such file" in capsys.readouterr().err


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET", "0") != "1",
                    reason="records the Triton launches under TRITON_INTERPRET=1")
def test_a_cpu_record_has_the_split_row_moves_and_the_cache_counts():
    from cachedemb.tools.step_record import record_step

    rec = record_step(bags=8, num_rows=5000, cache_rows=60, warmup=3, steps=1)
    moves = [e for e in rec["events"] if e["kind"] == "row_move"]
    assert [m["direction"] for m in moves] == ["out", "in"]  # the victims' rows leave before the misses land
    assert rec["rows_in_per_step"] > 0 and rec["rows_out_per_step"] > 0  # a full cache: evictions, dirty
    assert rec["events"][-1]["kind"] == "step_end" and rec["lookups_per_step"] == 8 * 26
    names = [e["name"] for e in rec["events"]]
    assert names.index("pooled_forward_kernel") < names.index("backward_update_kernel")
    assert sum(rec["launches_per_step"].values()) == len(rec["events"]) - 1
    assert rec["host_reads_per_step"] == {}  # the sync-free path reads no device value


def test_the_quick_suite_plan_fits_one_call():
    import shutil
    import subprocess

    script = ROOT / "scripts" / "gpu_suite.sh"
    proc = subprocess.run(["bash", str(script), "--dry-run", "quick"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    parts = [line.split()[0] for line in proc.stdout.splitlines() if "(timeout" in line]
    assert parts == ["tests_gpu", "row_move", "step", "step_prefetch", "two_rank", "peers", "profile", "report"]
    total = int(proc.stdout.split("parts' limits: ")[1].split()[0])
    assert total <= 500  # + install and start-up inside one 9-minute command
    bad = subprocess.run(["bash", str(script), "--dry-run", "nonsense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown stage 'nonsense'" in bad.stderr
    if shutil.which("shellcheck"):
        lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout


def test_the_quick_report_names_every_missing_part(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_quick_report", ROOT / "scripts" / "gpu_quick_report.py")
    report_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report_mod)
    (tmp_path / "step.rc").write_text("124\n")
    (tmp_path / "step.log").write_text("started\nkilled by timeout\n")
    report = report_mod.main([str(tmp_path)])
    assert json.loads((tmp_path / "quick.json").read_text())["parts_rc"] == {"step": 124}
    assert report["failed_parts"]["step"] == ["started", "killed by timeout"]
    assert "missing" in report["row_move"] and "missing" in report["two_rank"]
    assert report["model"]["calibration_abfc35d"]  # the calibration is always there
    with pytest.raises(SystemExit, match="usage"):
        report_mod.main([str(tmp_path / "nope")])
