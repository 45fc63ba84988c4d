"""The recipe's model and defaults: DCNv2 cross layers against brute force, learning-rate schedule, and no loss
spike in the first steps of the reference-derived presets on Criteo-format data."""
import csv
import math

import numpy as np
import pytest
import torch

pytest.importorskip("tqdm")

from cachedemb.recipes.dlrm import main as dlrm_main  # noqa: E402
from cachedemb.recipes.dlrm.configs import PRESETS  # noqa: E402
from cachedemb.recipes.dlrm.data import PreprocessedSplit, load_metadata, synthetic_criteo  # noqa: E402
from cachedemb.recipes.dlrm.lr_schedule import LRSchedule  # noqa: E402
from cachedemb.recipes.dlrm.model import DLRM, DLRMConfig, PlainLowRankCrossNet  # noqa: E402

ROWS = 12_000
# Criteo's 26 features with tables a few thousand rows at most: the model's shape is the preset's, only the
# tables (and so host memory) are small.
SMALL_CRITEO = synthetic_criteo(scale=1 / 4000, min_large=2000)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def criteo_dir(tmp_path_factory, criteo_kaggle_dir):
    return criteo_kaggle_dir(tmp_path_factory.mktemp("criteo_format"), ROWS, SMALL_CRITEO, seed=3)


def _first_losses(data_dir, tmp_path, preset: str, steps: int, extra: list[str]) -> list[float]:
    """Per-step train losses of the recipe's own build() and train() at the preset's defaults (+ extra)."""
    args = dlrm_main.parse_args(["--data", preset, "--data-dir", str(data_dir), "--device", "cpu", "--quiet",
                                 "--log-every", "1", "--limit-batches", str(steps)] + extra)
    args.log_dir = str(tmp_path / preset)
    if hasattr(dlrm_main, "init_distributed"):  # the torchrun-aware recipe: a single process joins no job
        dlrm_main.init_distributed(args)
    model, dense_opt = dlrm_main.build(args, args.preset, load_metadata(data_dir), data_dir)
    logger = dlrm_main.Logger(args.log_dir)
    try:
        dlrm_main.train(model, dense_opt, PreprocessedSplit(data_dir, "train"), args,
                        {"epoch": 0, "batch": 0, "step": 0}, logger)
    finally:
        logger.close()
    with open(tmp_path / preset / "train_log.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


@pytest.mark.parametrize("preset, batch", [("criteo-kaggle", 512), ("criteo-1tb", 128)])
def test_first_losses_stay_near_log2(criteo_dir, tmp_path, preset, batch):
    # The label rate of this data is ~0.3 (best constant loss ~0.61); a fresh model predicts ~0.5 (log 2).
    losses = _first_losses(criteo_dir, tmp_path, preset, 12, ["--batch-size", str(batch)])
    assert len(losses) == 12
    assert max(losses) < 0.8, losses
    assert abs(losses[0] - math.log(2)) < 0.05, losses


def test_former_defaults_spike(criteo_dir, tmp_path):
    # The check above can fail: the former Kaggle defaults (Adagrad lr 0.05 for both, no warm-up) blow up.
    losses = _first_losses(criteo_dir, tmp_path, "criteo-kaggle", 6,
                           ["--batch-size", "512", "--lr", "0.05", "--dense-lr", "0.05", "--lr-warmup-steps", "0"])
    assert max(losses) > 2.0, losses


def test_presets_cite_the_reference():
    mlperf = PRESETS["criteo-1tb"]
    assert (mlperf.optimizer, mlperf.dense_optimizer, mlperf.lr, mlperf.dense_lr) == ("adagrad", "adagrad", 0.005,
                                                                                      0.005)
    assert (mlperf.batch_size, mlperf.embedding_dim, mlperf.interaction) == (65536, 128, "dcn")
    assert (mlperf.dcn_num_layers, mlperf.dcn_low_rank_dim) == (3, 512)
    assert mlperf.dense_arch_layer_sizes == (512, 256, 128)
    assert mlperf.over_arch_layer_sizes == (1024, 1024, 512, 256, 1)


def test_lr_schedule():
    s = LRSchedule(warmup_steps=3, decay_start=5, decay_steps=4)
    got = [s.scale(t) for t in range(1, 12)]
    # The reference's LRPolicyScheduler at step counts 1..11 (decay from step 5 over 4 steps, then held).
    want = [1 / 3, 2 / 3, 1, 1, 1, (3 / 4) ** 2, (2 / 4) ** 2, (1 / 4) ** 2, (1 / 4) ** 2, (1 / 4) ** 2, (1 / 4) ** 2]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert [LRSchedule().scale(t) for t in (1, 10**6)] == [1.0, 1.0]
    with pytest.raises(ValueError, match="decay_start=1 < warmup_steps=2"):
        LRSchedule(warmup_steps=2, decay_start=1, decay_steps=1)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        LRSchedule(warmup_steps=-1)


def test_dcn_cross_layer_brute_force():
    torch.manual_seed(0)
    n, r, batch = 6, 3, 4
    net = PlainLowRankCrossNet(n, num_layers=1, low_rank=r).double()
    with torch.no_grad():
        net.bias[0].normal_()
    x0 = torch.randn(batch, n, dtype=torch.float64)
    W, V, b = net.W_kernels[0], net.V_kernels[0], net.bias[0]
    # x1_i = x0_i * (sum_k W_ik sum_j V_kj x0_j + b_i) + x0_i, one scalar at a time.
    want = torch.empty_like(x0)
    for s in range(batch):
        for i in range(n):
            acc = sum(float(W[i, k]) * sum(float(V[k, j]) * float(x0[s, j]) for j in range(n)) for k in range(r))
            want[s, i] = float(x0[s, i]) * (acc + float(b[i])) + float(x0[s, i])
    torch.testing.assert_close(net(x0), want, rtol=1e-12, atol=1e-12)


def test_dcn_model_shapes_and_torchrec_equal():
    config = DLRMConfig(num_dense=3, cat_names=("a", "b", "c"), table_sizes=(11, 7, 5), embedding_dim=4,
                        dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(6, 1), interaction="dcn",
                        dcn_num_layers=2, dcn_low_rank_dim=5)
    assert config.interaction_out_features() == (3 + 1) * 4
    plain = DLRM(config, cache_ratio=0.5, use_torchrec=False, device="cpu")
    cross = plain.inter_arch.crossnet
    assert [tuple(p.shape) for p in cross.W_kernels] == [(16, 5)] * 2
    assert [tuple(p.shape) for p in cross.V_kernels] == [(5, 16)] * 2
    dense = torch.randn(6, 3)
    ids = torch.stack([torch.randint(0, n, (6,)) for n in config.table_sizes], dim=1)
    assert plain(dense, ids).shape == (6,)
    with pytest.raises(ValueError, match="interaction='cross'"):
        DLRMConfig(num_dense=1, cat_names=("a",), table_sizes=(3,), embedding_dim=2, interaction="cross")
    pytest.importorskip("torchrec")
    ref = DLRM(config, cache_ratio=0.5, use_torchrec=True, device="cpu")
    dense_ref, dense_plain = ref.dense_parameters(), plain.dense_parameters()
    assert [p.shape for p in dense_ref] == [p.shape for p in dense_plain]
    for p, q in zip(dense_ref, dense_plain):
        q.data.copy_(p.data)
    plain.sparse_arch.load_state_dict(ref.sparse_arch.state_dict())
    torch.testing.assert_close(plain(dense, ids), ref(dense, ids))
