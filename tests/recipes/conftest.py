"""Shared setup of the recipe tests that train the DLRM on small Criteo-format data."""
import pytest
import torch

from cachedemb.recipes.dlrm.data import preprocess_criteo_kaggle, write_criteo_tsv


@pytest.fixture
def one_thread():
    """Small matmuls: on a busy 2-core box two intra-op threads spin against each other (measured 30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def criteo_kaggle_dir():
    """Builds a Criteo-Kaggle-format train.txt of `rows` lines over `config`'s tables in `root`, preprocessed
    (90% train, 10% val); returns the preprocessed directory."""
    def build(root, rows: int, config, seed: int):
        write_criteo_tsv(root / "train.txt", rows, config.table_sizes, seed=seed)
        return preprocess_criteo_kaggle(root / "train.txt", root / "pre", config=config, train_fraction=0.9,
                                        val_fraction=0.1)
    return build
