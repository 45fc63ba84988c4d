"""The DLRM recipe's command line: flags, their defaults and help, and checks that end in an argparse error
(exit code 2, the usage line, the flag and the bad value) before any data is generated or read."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from cachedemb import optim, sizing

from .configs import DATA_PRESET, INTERACTIONS, PRESETS, get_preset
from .lr_schedule import LRSchedule

PROG = "python -m cachedemb.recipes.dlrm.main"
SPARSE_OPTIMIZERS = {"sgd": optim.SGD, "adagrad": optim.Adagrad, "rowwise_adagrad": optim.RowWiseAdagrad,
                     "adam": optim.Adam}

DESCRIPTION = """\
Train a DLRM click-through-rate model whose embedding tables live in host
memory (or in files: --table-dir) behind a small GPU cache
(cachedemb.CachedEmbeddingBagCollection), evaluate it on the validation split,
and print the AUC, log loss, samples/s and cache hit rate.

--data synthetic (the default) generates a Criteo-format data set with a
planted signal (Zipf-distributed ids, labels a model can learn) and
preprocesses it once; criteo-kaggle, criteo-1tb and avazu are preprocessed from
their raw files in --data-dir on first use. A default given "per --data" comes
from that data set's preset (recipes/dlrm/configs.py cites its sources)."""

EPILOG = f"""\
example (tiny synthetic data, under a minute on a laptop CPU):
  {PROG} --synthetic-samples 100000 --epochs 1

The result is a short summary on stdout; --metrics-file PATH also writes every
figure as JSON ('-': the JSON on stdout, the summary on stderr). Under torchrun
the same flags shard the tables over the ranks (docs/dlrm_recipe.md)."""


# ------------------------------------------------------------------------------------- value types
def _int(text: str, what: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _int(text, "a whole number >= 1", 1)


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    return _int(text, "a whole number >= 0", 0)


def positive_float(text: str) -> float:
    """A finite float > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def ratio(text: str) -> float:
    """A fraction in (0, 1]: the share of each table's rows its cache holds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a fraction of each table's rows in (0, 1], e.g. 0.01 for 1%, "
                                         f"got {text!r}")
    return value


def byte_size(text: str) -> int:
    """A byte count with an optional unit (8GiB, 512MB), > 0."""
    try:
        value = sizing.parse_bytes(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a byte size > 0 with an optional unit (B, KB, MB, GB, KiB, MiB, "
                                         f"GiB, TiB), e.g. 8GiB, got {text!r}")
    return value


class _DeprecatedAlias(argparse.Action):
    """A former flag name: sets the new flag's value and says, on stderr, which name to use."""

    def __init__(self, option_strings, dest, new_name: str, **kwargs):
        self.new_name = new_name
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new_name}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _per_data(field: str) -> str:
    """'per --data: synthetic 16, criteo-kaggle 16, ...' from the presets (one value when they all agree)."""
    values = {data: getattr(PRESETS[preset], field) for data, preset in DATA_PRESET.items()}
    if len(set(values.values())) == 1:
        return f"default: {next(iter(values.values()))}"
    return "default per --data: " + ", ".join(f"{d} {v}" for d, v in values.items())


# ------------------------------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, usage="%(prog)s [--data NAME] [--data-dir DIR] [options]",
                                description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", choices=sorted(DATA_PRESET), default="synthetic",
                   help="data set to train on (default: %(default)s)")
    g.add_argument("--data-dir", default=None, metavar="DIR",
                   help="directory of the raw files (real data sets), or where --data synthetic generates its data "
                        "(default: ./data/synthetic for synthetic; required otherwise)")
    g.add_argument("--synthetic-samples", type=positive_int, default=None, metavar="N",
                   help="samples (lines of the Criteo-format file) to generate for --data synthetic, 90%% train / "
                        f"10%% val (default: {PRESETS['synthetic-demo'].synthetic_samples})")
    g.add_argument("--synthetic-rows", type=positive_int, dest="synthetic_samples", action=_DeprecatedAlias,
                   new_name="--synthetic-samples", help=argparse.SUPPRESS)
    g.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="preprocessing processes (default: all cores)")

    g = p.add_argument_group("embedding cache")
    g.add_argument("--cache-ratio", type=ratio, default=None, metavar="R",
                   help="share of each table's rows its GPU cache holds, in (0, 1] "
                        f"({_per_data('cache_ratio')})")
    g.add_argument("--cache-budget", type=byte_size, default=None, metavar="BYTES",
                   help="device bytes for all caches together (e.g. 8GiB), split over the tables from the train "
                        "split's miss-ratio curves (cachedemb.sizing) instead of --cache-ratio (default: off)")
    g.add_argument("--prefetch-depth", type=non_negative_int, default=0, metavar="K",
                   help="batches whose rows are fetched ahead of the step that needs them (default: %(default)s, "
                        "off)")
    g.add_argument("--prefetch-horizon", type=positive_int, default=None, metavar="H",
                   help="batches whose ids the prefetcher reads ahead to choose what to keep, >= --prefetch-depth "
                        "(default: --prefetch-depth)")
    g.add_argument("--table-dir", default=None, metavar="DIR",
                   help="keep the embedding tables in files here (cachedemb.FileStorage: tables larger than host "
                        "memory); with --resume the files continue from the checkpoint's snapshots (default: "
                        "tables in host memory)")
    g.add_argument("--host-cache-mb", type=positive_int, default=1024, metavar="MIB",
                   help="with --table-dir: host memory for cached rows of all tables together, in MiB "
                        "(default: %(default)s)")

    g = p.add_argument_group("model and optimizer")
    g.add_argument("--embedding-dim", type=positive_int, default=None, metavar="D",
                   help=f"embedding dimension ({_per_data('embedding_dim')})")
    g.add_argument("--interaction", choices=INTERACTIONS, default=None,
                   help=f"dot (DLRM) or dcn (DCNv2 cross layers) ({_per_data('interaction')})")
    g.add_argument("--dcn-num-layers", type=positive_int, default=None, metavar="N",
                   help=f"with --interaction dcn: cross layers ({_per_data('dcn_num_layers')})")
    g.add_argument("--dcn-low-rank-dim", type=positive_int, default=None, metavar="N",
                   help=f"with --interaction dcn: rank of each cross layer ({_per_data('dcn_low_rank_dim')})")
    g.add_argument("--optimizer", choices=sorted(SPARSE_OPTIMIZERS), default=None,
                   help=f"embedding optimizer ({_per_data('optimizer')})")
    g.add_argument("--lr", type=positive_float, default=None, help=f"embedding learning rate ({_per_data('lr')})")
    g.add_argument("--dense-optimizer", choices=["adagrad", "sgd"], default=None,
                   help=f"optimizer of the MLPs ({_per_data('dense_optimizer')})")
    g.add_argument("--dense-lr", type=positive_float, default=None,
                   help=f"learning rate of the MLPs ({_per_data('dense_lr')})")
    g.add_argument("--lr-warmup-steps", type=non_negative_int, default=None, metavar="N",
                   help=f"linear warm-up of both learning rates ({_per_data('lr_warmup_steps')})")
    g.add_argument("--lr-decay-start", type=non_negative_int, default=None, metavar="STEP",
                   help=f"step where the quadratic decay starts ({_per_data('lr_decay_start')})")
    g.add_argument("--lr-decay-steps", type=non_negative_int, default=None, metavar="N",
                   help=f"steps of quadratic decay, 0 = none ({_per_data('lr_decay_steps')})")

    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                   help=f"samples per step, over all ranks under torchrun ({_per_data('batch_size')})")
    g.add_argument("--epochs", type=positive_int, default=None, metavar="N",
                   help=f"passes over the train split ({_per_data('epochs')})")
    g.add_argument("--limit-batches", type=positive_int, default=None, metavar="N",
                   help="train at most N batches per epoch (default: the whole split)")
    g.add_argument("--eval-batches", type=positive_int, default=None, metavar="N",
                   help="evaluate at most N val batches (default: the whole split)")
    g.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the model's initial weights and of the batch order (default: %(default)s)")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--stop-after-steps", type=positive_int, default=None, help=argparse.SUPPRESS)  # a crash

    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where checkpoints and the final model (final.pt) go (default: none written)")
    g.add_argument("--checkpoint-every", type=non_negative_int, default=0, metavar="STEPS",
                   help="steps between checkpoints, 0 = only the final one (default: %(default)s)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (default: off)")

    g = p.add_argument_group("output")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bars, progress lines or sizing table; the result is still printed "
                        "(default: off; bars are also off when stderr is not a terminal)")
    g.add_argument("--log-every", type=positive_int, default=50, metavar="STEPS",
                   help="steps between loss / hit-rate updates of the progress bar, the --log-dir CSV and, when "
                        "stderr is not a terminal, a progress line (default: %(default)s)")
    g.add_argument("--log-dir", default=None, metavar="DIR",
                   help="write train_log.csv (and TensorBoard events if installed) and metrics.json here "
                        "(default: none)")
    g.add_argument("--metrics-file", default=None, metavar="PATH",
                   help="write the final metrics as JSON to PATH; '-' prints them on stdout as one line (the "
                        "summary then goes to stderr) (default: DIR/metrics.json with --log-dir, else none)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags -> a namespace with the --data preset's values filled in, `lr_schedule`, `device` and `preset`.
    Bad values and contradicting flags end in `parser.error` (SystemExit(2)) before any work starts."""
    p = build_parser()
    args = p.parse_args(argv)
    preset = get_preset(DATA_PRESET[args.data])
    for name in ("synthetic_samples", "cache_ratio", "optimizer", "lr", "dense_optimizer", "dense_lr",
                 "embedding_dim", "batch_size", "epochs", "lr_warmup_steps", "lr_decay_start", "lr_decay_steps",
                 "interaction", "dcn_num_layers", "dcn_low_rank_dim"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.data != "synthetic" and args.data_dir is None:
        p.error(f"--data {args.data} needs --data-dir (the directory of its raw files)")
    if args.prefetch_horizon is not None and args.prefetch_horizon < args.prefetch_depth:
        p.error(f"argument --prefetch-horizon: expected a number of batches >= --prefetch-depth "
                f"({args.prefetch_depth}), got {args.prefetch_horizon}")
    if args.table_dir is not None:
        existing = sorted(Path(args.table_dir).glob("*.cemb")) if Path(args.table_dir).is_dir() else []
        if existing and not args.resume:
            p.error(f"argument --table-dir: {args.table_dir!r} already holds table files ({existing[0].name}, "
                    "...): continue them with --resume, or give an empty directory")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        p.error("--checkpoint-every and --resume need --checkpoint-dir (where the checkpoints are)")
    if args.metrics_file is None and args.log_dir is not None:
        args.metrics_file = str(Path(args.log_dir) / "metrics.json")
    args.lr_schedule = LRSchedule(args.lr_warmup_steps, args.lr_decay_start, args.lr_decay_steps)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.preset = preset
    return args
