"""One JSON from the parts `scripts/gpu_suite.sh quick` wrote into its output folder: the GPU tests' outcome, the
row-move microbenchmark, the steps with and without prefetch against the table in GPU memory (rows moved per
step, their GB/s from the profile's row-move kernel time, hit rate), the two-rank job, the ColossalAI peer, and
scripts/gpu_model.py's prediction beside each measured step (constants re-read from this run's row-move
benchmark where it ran). A part that is missing or failed is reported as such, with its log's tail.

    python scripts/gpu_quick_report.py OUT_DIR            # writes OUT_DIR/quick.json and prints it
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW_MOVE_KERNELS = ("row_stream_kernel", "row_move_kernel")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"missing": f"{path.name}: {type(e).__name__}: {e}"[:300]}


def _tail(path: Path, n: int = 30) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return [f"{path.name}: not written"]


def _rc(out: Path, part: str):
    try:
        return int((out / f"{part}.rc").read_text().strip())
    except (OSError, ValueError):
        return None


def tests_part(out: Path) -> dict:
    log = out / "tests_gpu.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    summary = re.findall(r"=+ (.*(?:passed|failed|error|skipped|deselected).*) =+", text)
    return {"rc": _rc(out, "tests_gpu"), "summary": summary[-1] if summary else None,
            "failures": re.findall(r"^(?:FAILED|ERROR) .*", text, flags=re.M)}


def step_part(out: Path, profile: dict) -> dict:
    plain, pre = _json(out / "embedding_bag_step.json"), _json(out / "embedding_bag_step_prefetch.json")
    res = {}
    prof_runs = {r["prefetch_depth"]: r for r in profile.get("runs", [])}
    for name, d, depth in (("no_prefetch", plain, 0), ("prefetch", pre, 4)):
        if "runs" not in d:
            res[name] = d
            continue
        r, cfg = d["runs"][0], d["config"]
        row = {"step_ms": r.get("cached_step_s", 0) * 1e3, "hit_rate": r.get("hit_rate"),
               "rows_in_per_step": r.get("rows_in_per_batch"), "rows_out_per_step": r.get("rows_out_per_batch")}
        if r.get("reference_step_s"):
            res["in_memory"] = {"step_ms": r["reference_step_s"] * 1e3}
            row["ratio_to_in_memory"] = r["cached_step_s"] / r["reference_step_s"]
        pr = prof_runs.get(depth)
        if pr and row["rows_in_per_step"] is not None:
            move_ms = sum(ms for k, ms, _ in pr["top_kernels_ms_per_step"] if k in ROW_MOVE_KERNELS)
            nbytes = (row["rows_in_per_step"] + (row["rows_out_per_step"] or 0)) * cfg["dim"] * 4
            row["row_move_ms_per_step"] = move_ms
            row["row_move_GBps"] = nbytes / (move_ms / 1e3) / 1e9 if move_ms else None
        res[name] = row
    if "in_memory" in res and "prefetch" in res and "step_ms" in res.get("prefetch", {}):
        res["prefetch"]["ratio_to_in_memory"] = res["prefetch"]["step_ms"] / res["in_memory"]["step_ms"]
    return res


def model_part(out: Path, steps: dict) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_model

    try:
        cal = gpu_model.calibration()
        row_move = out / "row_move.json"
        c = gpu_model.load_constants(gpu_model.DEFAULT_KERNELS, row_move if row_move.exists() else None)
        m = steps.get("no_prefetch", {})
        unique = _json(out / "embedding_bag_step.json").get("runs", [{}])[0].get("unique_per_batch")
        records = [ROOT / "benchmarks" / "results" / f for f in ("step_record_cpu.json",
                                                                  "step_record_cpu_prefetch4.json")]
        if unique is None or m.get("hit_rate") is None or not all(p.exists() for p in records):
            return {"calibration_abfc35d": cal, "current_tree": "no step measured or no CPU record"}
        rec, pre = (json.loads(p.read_text()) for p in records)
        pred = gpu_model.predict(c, gpu_model.Shape(), unique, m["hit_rate"], record=rec, prefetch_record=pre)
        side = {k: {"predicted_ms": v["step_ms"], "measured_ms": steps.get(k, {}).get("step_ms"),
                    "error": (v["step_ms"] / steps[k]["step_ms"] - 1) if steps.get(k, {}).get("step_ms") else None,
                    "breakdown": v} for k, v in pred.items()}
        return {"constants": vars(c), "calibration_abfc35d": {k: {x: v[x] for x in ("predicted_ms", "measured_ms",
                                                                                    "error")}
                                                              for k, v in cal["steps"].items()},
                "current_tree": side}
    except Exception as e:  # noqa: BLE001 -- a model error is reported, the measured parts still are
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        raise SystemExit(f"usage: gpu_quick_report.py OUT_DIR (a folder gpu_suite.sh quick wrote); got {argv}")
    out = Path(argv[0])
    profile = _json(out / "profile_step.json")
    steps = step_part(out, profile)
    report = {
        "device": (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else None,
        "git": (out / "git.txt").read_text().strip() if (out / "git.txt").exists() else None,
        "parts_rc": {p.stem: _rc(out, p.stem) for p in sorted(out.glob("*.rc"))},
        "tests": tests_part(out),
        "row_move": _json(out / "row_move.json"),
        "steps": steps,
        "two_rank": _json(out / "two_rank.json"),
        "colossalai": _json(out / "peers.json"),
        "profile": {"runs": [{k: r[k] for k in ("prefetch_depth", "step_ms", "device_ms_per_step",
                                                "runtime_calls_per_step", "top_kernels_ms_per_step")}
                             for r in profile.get("runs", [])]} if "runs" in profile else profile,
        "model": model_part(out, steps),
    }
    for part in ("tests_gpu", "row_move", "step", "step_prefetch", "two_rank", "peers", "profile"):
        if _rc(out, part) not in (0, None):
            report.setdefault("failed_parts", {})[part] = _tail(out / f"{part}.log")
    text = json.dumps(report, indent=1, default=str)
    (out / "quick.json").write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
