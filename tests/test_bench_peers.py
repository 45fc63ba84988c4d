"""scripts/bench_peers.py on a tiny CPU shape: the JSON's structure, peers that cannot run say why, the cached
tables equal the in-memory one after the same steps, and the comparison catches a peer that trains differently.
Never asserts on timing."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_peers.py"
TINY = ["--rows", "6000", "--dim", "16", "--batch", "32", "--pooling", "8", "--cache-ratio", "0.05",
        "--warmup", "1", "--steps", "2", "--depth", "2", "--horizon", "4", "--device", "cpu"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def has_fbgemm() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401 - importable is what is checked
        return True
    except Exception:  # noqa: BLE001 - a broken native build counts as absent
        return False


@pytest.fixture(scope="module")
def bench():
    return load_bench()


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "peers.json"

    class Broken(bench.Peer):
        name, label = "broken", "raises inside a step"

        def build(self, init, cfg, device):
            pass

        def step(self, ids, offsets):
            raise RuntimeError("boom in step")

    wrong = bench.CachedembPeer(prefetch=False, lr_scale=1.5)  # trains with another lr: its table must differ
    wrong.name = "cachedemb_wrong_lr"
    peers = bench.default_peers() + [wrong, Broken()]
    # A peer after the broken one (a failure must not stop it): the FBGEMM adapter over FBGEMM's CPU kernels where
    # fbgemm_gpu imports, else a second cachedemb run (the fresh environments of check_versions have no fbgemm).
    if has_fbgemm():
        peers.append(bench.FbgemmPeer(location="host"))
    else:
        after = bench.CachedembPeer(prefetch=False)
        after.name = "cachedemb_after_broken"
        peers.append(after)
    report = bench.main(TINY + ["--machine", "test", "--out", str(out)], peers=peers)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    return report, out


def by_name(report):
    return {r["name"]: r for r in report["peers"]}


def test_report_structure(report):
    report, out = report
    assert report["benchmark"] == "peers"
    assert report["machine"]["description"] == "test" and report["machine"]["device"] == "cpu"
    cfg = report["config"]
    assert (cfg["rows"], cfg["dim"], cfg["batch"], cfg["pooling"], cfg["cache_ratio"]) == (6000, 16, 32, 8, 0.05)
    assert 0 < cfg["distinct_ids_per_batch"] <= 32 * 8
    peers = by_name(report)
    assert {"nn_embedding_bag", "colossalai", "fbgemm_uvm_caching", "cachedemb", "cachedemb_prefetch"} <= set(peers)
    for rec in report["peers"]:
        assert rec["status"] in ("ok", "unavailable", "failed")
        if rec["status"] != "ok":
            assert rec["reason"]
            continue
        assert rec["timed_steps"] == 2
        assert rec["samples_per_s"] > 0 and rec["step_s_median"] > 0
        assert rec["device_memory_peak_bytes"] is None  # a CPU run has no device memory counter
    for name in ("cachedemb", "cachedemb_prefetch"):
        rec = peers[name]
        assert 0.0 <= rec["hit_rate"] <= 1.0
        assert isinstance(rec["rows_in"], int) and rec["rows_in"] >= 0
        assert rec["cache_rows"] == 300
    assert peers["cachedemb_prefetch"]["depth"] == 2
    summary = report["summary"]
    assert summary["goals"]["samples_per_s_ge_2x_colossalai"] is None  # ColossalAI did not run: unmeasured
    assert summary["cachedemb_over_colossalai_samples_per_s"] is None
    assert summary["prefetch_over_no_prefetch_step"] is not None
    png = Path(report["png"])
    assert png == out.with_suffix(".png") and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peers_that_cannot_run_say_why(report):
    peers = by_name(report[0])
    if not torch.cuda.is_available():
        for name in ("colossalai", "fbgemm_uvm_caching"):
            assert peers[name]["status"] == "unavailable"
            assert peers[name]["reason"].startswith("needs CUDA")
    broken = peers["broken"]
    assert broken["status"] == "failed" and "boom in step" in broken["reason"]
    # A failing peer does not stop the ones after it.
    assert report[0]["peers"][-1]["status"] in ("ok", "unavailable")


def test_cached_tables_equal_the_in_memory_table(report):
    peers = by_name(report[0])
    assert peers["nn_embedding_bag"]["status"] == "ok"
    assert peers["nn_embedding_bag"]["table_check"] == {"role": "reference"}
    names = ["cachedemb", "cachedemb_prefetch"] + (["fbgemm_host"] if has_fbgemm() else [])
    for name in names:
        check = peers[name]["table_check"]
        assert peers[name]["status"] == "ok", peers[name].get("reason")
        assert check["matches_reference"] is True, (name, check)
        assert check["max_abs_diff"] <= check["tolerance"] and check["rows_differing"] == 0


def test_a_peer_that_trains_differently_is_reported(report):
    check = by_name(report[0])["cachedemb_wrong_lr"]["table_check"]
    assert check["matches_reference"] is False
    assert check["max_abs_diff"] > check["tolerance"] and check["rows_differing"] > 0


def test_compare_tables(bench):
    ref = torch.randn(10, 4)
    other = ref.clone()
    assert bench.compare_tables(other, ref, chunk=3)["bit_equal"] is True
    other[7, 2] += 1e-3
    check = bench.compare_tables(other, ref, chunk=3)
    assert (check["matches_reference"], check["rows_differing"], check["bit_equal"]) == (False, 1, False)
    assert check["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert bench.compare_tables(torch.zeros(9, 4), ref)["matches_reference"] is False


def test_command_line(tmp_path):
    out = tmp_path / "cli.json"
    args = list(TINY)
    subprocess.run([sys.executable, str(SCRIPT), *args, "--peers", "nn_embedding_bag", "cachedemb",
                    "--out", str(out), "--png", str(tmp_path / "chart.png")],
                   check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["peers"]] == ["nn_embedding_bag", "cachedemb"]
    assert report["peers"][1]["table_check"]["matches_reference"] is True
    assert (tmp_path / "chart.png").exists()
    bad = subprocess.run([sys.executable, str(SCRIPT), *args, "--peers", "nope"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "unknown ['nope']" in bad.stderr
