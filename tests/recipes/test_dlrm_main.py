"""The DLRM recipe end to end: learns the planted signal, resumes bit-exactly, names missing files."""
import pytest
import torch

pytest.importorskip("torchmetrics")
pytest.importorskip("tqdm")

import cachedemb  # noqa: E402
from cachedemb.recipes.dlrm import main as dlrm_main  # noqa: E402

ROWS = 100_000
# Small and fast: dim 8, batch 1024, 1% cache; one epoch over 90k train rows reaches AUC ~0.74 (oracle 0.79).
COMMON = ["--synthetic-samples", str(ROWS), "--embedding-dim", "8", "--batch-size", "1024", "--quiet",
          "--cache-ratio", "0.01", "--device", "cpu"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("synthetic"))


def test_learns_planted_signal(data_dir, tmp_path):
    metrics = dlrm_main.main(COMMON + ["--data-dir", data_dir, "--epochs", "1", "--log-dir", str(tmp_path / "log"),
                                       "--log-every", "10"])
    assert metrics["auc"] > 0.7, metrics
    assert 0 < metrics["cache_hit_rate"] <= 1
    assert metrics["samples_per_s"] > 0 and metrics["logloss"] < 0.69
    assert (tmp_path / "log" / "train_log.csv").read_text().count("\n") > 2


def _final_model(ckpt_dir):
    return torch.load(f"{ckpt_dir}/final.pt", map_location="cpu", weights_only=True)


def test_resume_equals_uninterrupted_run(data_dir, tmp_path):
    run = COMMON + ["--data-dir", data_dir, "--epochs", "2", "--limit-batches", "6", "--eval-batches", "2",
                    "--optimizer", "adam"]
    full = dlrm_main.main(run + ["--checkpoint-dir", str(tmp_path / "full")])
    # Crash after step 8 (checkpoints at 3, 6: the latest is mid-epoch 1), then resume.
    part = tmp_path / "part"
    dlrm_main.main(run + ["--checkpoint-dir", str(part), "--checkpoint-every", "3", "--stop-after-steps", "8"])
    assert not (part / "final.pt").exists()
    resumed = dlrm_main.main(run + ["--checkpoint-dir", str(part), "--resume"])
    assert resumed["steps"] == full["steps"] == 12
    a, b = _final_model(tmp_path / "full"), _final_model(part)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert resumed["auc"] == full["auc"] and resumed["logloss"] == full["logloss"]


def test_missing_data_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.txt"):
        dlrm_main.main(["--data", "criteo-kaggle", "--data-dir", str(tmp_path), "--quiet"])
    with pytest.raises(FileNotFoundError, match="day_"):
        dlrm_main.main(["--data", "criteo-1tb", "--data-dir", str(tmp_path), "--quiet"])
    with pytest.raises(FileNotFoundError, match="train.csv"):
        dlrm_main.main(["--data", "avazu", "--data-dir", str(tmp_path), "--quiet"])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        dlrm_main.main(["--data", "avazu", "--data-dir", str(tmp_path / "nowhere"), "--quiet"])


def test_resume_without_checkpoint_names_it(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="latest.pt"):
        dlrm_main.main(COMMON + ["--data-dir", data_dir, "--checkpoint-dir", str(tmp_path), "--resume"])


def test_plain_torch_arches_equal_torchrec_arches():
    pytest.importorskip("torchrec")
    from cachedemb.recipes.dlrm.model import DLRM, DLRMConfig

    config = DLRMConfig(num_dense=3, cat_names=("a", "b", "c"), table_sizes=(11, 7, 5), embedding_dim=4,
                        dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(6, 1))
    ref = DLRM(config, cache_ratio=0.5, use_torchrec=True, device="cpu")
    plain = DLRM(config, cache_ratio=0.5, use_torchrec=False, device="cpu")
    dense_ref, dense_plain = ref.dense_parameters(), plain.dense_parameters()
    assert [p.shape for p in dense_ref] == [p.shape for p in dense_plain]
    for p, q in zip(dense_ref, dense_plain):
        q.data.copy_(p.data)
    plain.sparse_arch.load_state_dict(ref.sparse_arch.state_dict())
    sparse_keys = set(plain.sparse_arch.state_dict())
    assert sparse_keys == {"embedding_bags.t_a.weight", "embedding_bags.t_b.weight", "embedding_bags.t_c.weight"}
    dense = torch.randn(6, 3)
    ids = torch.stack([torch.randint(0, n, (6,)) for n in config.table_sizes], dim=1)
    torch.testing.assert_close(plain(dense, ids), ref(dense, ids))


def test_prefetch_gives_the_same_training(data_dir, tmp_path):
    pytest.importorskip("cachedemb.prefetch")
    run = COMMON + ["--data-dir", data_dir, "--limit-batches", "5", "--eval-batches", "1", "--cache-ratio", "0.5"]
    dlrm_main.main(run + ["--checkpoint-dir", str(tmp_path / "plain")])
    dlrm_main.main(run + ["--checkpoint-dir", str(tmp_path / "pf"), "--prefetch-depth", "2",
                          "--prefetch-horizon", "4"])
    a, b = _final_model(tmp_path / "plain"), _final_model(tmp_path / "pf")
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("host_mb", ["1", "32"], ids=["in_place", "log"])
def test_table_dir_trains_as_in_memory_and_resumes(data_dir, tmp_path, host_mb, capsys):
    """--table-dir keeps the 26 tables in files behind a 1 MiB host cache (the larger tables written in place: a
    log's row map would take over a quarter of their share) or a 32 MiB one (every table a log): a run stopped
    after step 8 and resumed from its step-6 checkpoint (the snapshots it names) ends with the in-memory run's
    AUC, log loss and dense state, bit for bit."""
    run = COMMON + ["--data-dir", data_dir, "--epochs", "2", "--limit-batches", "6", "--eval-batches", "2",
                    "--optimizer", "adam"]
    memory = dlrm_main.main(run + ["--checkpoint-dir", str(tmp_path / "mem")])
    part = run + ["--checkpoint-dir", str(tmp_path / "part"), "--table-dir", str(tmp_path / "t2"),
                  "--host-cache-mb", host_mb]
    dlrm_main.main(part + ["--checkpoint-every", "3", "--stop-after-steps", "8"])
    with pytest.raises(SystemExit) as refused:  # an argparse error, before any work
        dlrm_main.main(part)
    assert refused.value.code == 2 and "already holds table files" in capsys.readouterr().err
    resumed = dlrm_main.main(part + ["--resume"])
    assert resumed["steps"] == 12 and (resumed["auc"], resumed["logloss"]) == (memory["auc"], memory["logloss"])
    a, b = _final_model(tmp_path / "mem"), _final_model(tmp_path / "part")
    dense = [k for k in a["model"] if not k.startswith("sparse_arch.")]
    assert dense and all(torch.equal(a["model"][k], b["model"][k]) for k in dense)
    logs = []
    for path in sorted((tmp_path / "t2").glob("*.cemb")):
        table = cachedemb.open_table(path)
        logs.append(table.is_log_file())
        table.close()
    assert len(logs) == 26 and (all(logs) if host_mb == "32" else not all(logs)), logs
