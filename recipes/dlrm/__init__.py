"""DLRM on Criteo Kaggle, Criteo 1TB, Avazu and synthetic data: the model, `main(argv)`, dataset configs and,
under `data/`, readers, preprocessing, the synthetic generator and the loader."""
