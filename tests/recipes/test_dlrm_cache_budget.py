"""The recipe's --cache-budget: caches sized from the train split (cachedemb.sizing) within the budget, and the
hit rate training measures within 2% (relative, of the miss ratio) of the one the sizing predicted."""
import types

import pytest

pytest.importorskip("torchmetrics")
pytest.importorskip("tqdm")

from cachedemb.recipes.dlrm import main as dlrm_main  # noqa: E402

COMMON = ["--synthetic-samples", "30000", "--embedding-dim", "8", "--batch-size", "512", "--quiet", "--device", "cpu",
          "--epochs", "1", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("synthetic_budget"))


@pytest.mark.parametrize("prefetch", [[], ["--prefetch-depth", "4", "--prefetch-horizon", "16"]],
                         ids=["lfu", "lookahead"])
def test_cache_budget_sizes_the_caches_and_predicts_the_hit_rate(data_dir, prefetch, one_thread):
    metrics = dlrm_main.main(COMMON + ["--data-dir", data_dir, "--cache-budget", "1MiB"] + prefetch)
    assert metrics["cache_budget_bytes"] == 1 << 20 and metrics["cache_budget_used"] <= 1 << 20
    assert len(metrics["cache_rows"]) == 1  # 26 tables of one dim: one group, one cache of their rows summed
    predicted, measured = 1 - metrics["predicted_cache_hit_rate"], 1 - metrics["cache_hit_rate"]
    assert 0.05 < measured < 0.95
    assert measured == pytest.approx(predicted, rel=0.02)


def test_cache_budget_is_single_process(capsys):
    args = types.SimpleNamespace(world=2)
    with pytest.raises(ValueError, match="under torchrun use --cache-ratio"):
        dlrm_main.size_caches(args, None, None, None)
    with pytest.raises(SystemExit) as bad:
        dlrm_main.parse_args(["--cache-budget", "lots"])
    assert bad.value.code == 2 and "--cache-budget: expected a byte size" in capsys.readouterr().err
