"""The DLRM recipe as a torchrun job (here: 2 spawned gloo ranks calling main(), as torchrun's ranks would):
disjoint data slices, metrics reduced across ranks, a sharded checkpoint resumed at 1 rank."""
import pytest
import torch

pytest.importorskip("torchmetrics")
pytest.importorskip("tqdm")

from cachedemb.distributed.testing import run_spawned  # noqa: E402
from cachedemb.recipes.dlrm import main as dlrm_main  # noqa: E402

BATCH = 128
COMMON = ["--synthetic-samples", "4000", "--embedding-dim", "4", "--batch-size", str(BATCH), "--quiet",
          "--cache-ratio", "0.05", "--device", "cpu", "--optimizer", "adagrad", "--eval-batches", "3",
          "--limit-batches", "4"]


def _rank(rank: int, world: int, argv: list[str]) -> dict:
    return dlrm_main.main(argv)


def _reference_eval(data_dir: str, state: dict) -> dict:
    """The gathered final model in a plain single-process DLRM, evaluated on the same val batches."""
    args = dlrm_main.parse_args(COMMON + ["--data-dir", data_dir])
    args.rank, args.world = 0, 1
    path = dlrm_main.prepare_data(args, args.preset)
    model, _ = dlrm_main.build(args, args.preset, dlrm_main.load_metadata(path), path)
    model.load_state_dict(state)
    return dlrm_main.evaluate(model, dlrm_main.PreprocessedSplit(path, "val"), args)


def test_two_rank_run_then_resume_at_one_rank(tmp_path):
    data_dir, ckpt = str(tmp_path / "data"), tmp_path / "ckpt"
    run = COMMON + ["--data-dir", data_dir, "--checkpoint-dir", str(ckpt)]
    # 4 global batches, 2 per rank: 2 steps, a sharded checkpoint (latest.dcp) after step 2, then final.pt.
    metrics = run_spawned(_rank, 2, run + ["--epochs", "1", "--checkpoint-every", "2"], timeout_s=120)
    m = metrics[0]
    assert metrics[1]["auc"] == m["auc"] and metrics[1]["train_samples"] == m["train_samples"]
    assert m["world_size"] == 2 and m["steps"] == 2 and m["train_samples"] == 4 * BATCH
    assert m["eval_rows"] == 3 * BATCH
    final = torch.load(ckpt / "final.pt", weights_only=True)
    reference = _reference_eval(data_dir, final["model"])
    assert reference["eval_rows"] == m["eval_rows"]
    assert reference["auc"] == pytest.approx(m["auc"], abs=1e-6)
    assert reference["logloss"] == pytest.approx(m["logloss"], rel=1e-5)
    assert reference["accuracy"] == pytest.approx(m["accuracy"], abs=1e-6)

    # The sharded checkpoint (after the last step) loads into a single-process model as the gathered state.
    args = dlrm_main.parse_args(COMMON + ["--data-dir", data_dir])
    args.rank, args.world = 0, 1
    path = dlrm_main.prepare_data(args, args.preset)
    single, dense_opt = dlrm_main.build(args, args.preset, dlrm_main.load_metadata(path), path)
    position = dlrm_main.resume(ckpt, single, dense_opt, args)
    assert position == {"epoch": 1, "batch": 0, "step": 2}
    state = single.state_dict()
    assert state.keys() == final["model"].keys()
    for key, value in final["model"].items():
        assert torch.equal(state[key], value), key
    # ... and --resume at 1 rank continues there: epoch 1's 4 global batches are 4 steps at world size 1.
    resumed = dlrm_main.main(run + ["--epochs", "2", "--resume"])
    assert resumed["steps"] == 6 and resumed["world_size"] == 1  # (a shuffled partial batch may be among them)


def test_two_rank_table_dir_trains_as_in_memory_and_resumes(tmp_path):
    """--table-dir under torchrun: each rank keeps its rows of each table in its own files behind a 1 MiB host
    cache; a run stopped after step 1 and resumed from its step-1 checkpoint (the snapshots it names) ends with
    the 2-rank in-memory run's AUC and log loss, bit for bit."""
    data_dir = str(tmp_path / "data")
    run = COMMON + ["--data-dir", data_dir, "--epochs", "1", "--optimizer", "adam"]
    memory = run_spawned(_rank, 2, run, timeout_s=180)[0]
    part = run + ["--checkpoint-dir", str(tmp_path / "ckpt"), "--table-dir", str(tmp_path / "tables"),
                  "--host-cache-mb", "1"]
    run_spawned(_rank, 2, part + ["--checkpoint-every", "1", "--stop-after-steps", "1"], timeout_s=180)
    files = sorted(p.name for p in (tmp_path / "tables").glob("*.cemb"))
    assert files and all(".rank0of2." in f or ".rank1of2." in f for f in files), files
    resumed = run_spawned(_rank, 2, part + ["--resume"], timeout_s=180)[0]
    assert resumed["steps"] == memory["steps"] == 2
    assert (resumed["auc"], resumed["logloss"]) == (memory["auc"], memory["logloss"])
    assert (tmp_path / "ckpt" / "final.dcp").is_dir() and not (tmp_path / "ckpt" / "final.pt").exists()
