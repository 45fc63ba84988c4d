"""Train and evaluate DLRM with a CachedEmbeddingBagCollection: `python -m cachedemb.recipes.dlrm.main --help`
(from a checkout's root `python -m recipes.dlrm.main` is the same program).

`main(argv)` returns the final metrics dict (full precision) and prints a short summary of it (--metrics-file also
writes it as JSON), so tests call it directly. The flags are in cli.py, progress bars in progress.py, the summary
in report.py.
Data: --data synthetic generates a planted-signal Criteo TSV and preprocesses it; the real data sets are
preprocessed from their raw files in --data-dir on first use (to --data-dir/preprocessed).

Under torchrun (`torchrun --nproc_per_node=N -m cachedemb.recipes.dlrm.main ...`, same flags) the tables are
sharded with cachedemb.distributed.shard (gloo on CPU, NCCL on GPU with device = LOCAL_RANK); rank r trains on
global batches r, r + N, ... (disjoint slices), evaluation metrics and samples/s are reduced across ranks and
printed by rank 0, and checkpoints are torch.distributed.checkpoint directories (latest.dcp) that --resume loads at any
world size (a single-process run included). With --table-dir each rank keeps its rows of each table in a file of its
own (`<table>.rank<r>of<w>.cemb`, --host-cache-mb per rank); the checkpoints then name the files' snapshots, so
--resume continues at the same world size (the final checkpoint is `final.dcp`, not a gathered final.pt).
"""
from __future__ import annotations

import contextlib
import csv
import importlib
import itertools
import shutil
import math
import os
import random
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import cachedemb
from cachedemb import sizing

from . import progress, report
from .cli import SPARSE_OPTIMIZERS, parse_args
from .configs import RunPreset
from .data import (PreprocessedSplit, load_id_freq, load_metadata, preprocess_avazu, preprocess_criteo_1tb,
                   preprocess_criteo_kaggle, write_criteo_tsv)
from .lr_schedule import set_learning_rates
from .model import DLRM, DLRMConfig

CHECKPOINT = "latest.pt"
DIST_CHECKPOINT = "latest.dcp"  # a torch.distributed.checkpoint directory (sharded runs), + TRAINER inside
TRAINER = "trainer.pt"  # dense optimizer, position, RNG of a sharded run
FINAL = "final.pt"
FINAL_DIST = "final.dcp"  # the end of a torchrun run with --table-dir: each rank's table files' snapshots


# --------------------------------------------------------------------------------------------- torchrun
def init_distributed(args) -> bool:
    """Join the torchrun job (WORLD_SIZE > 1) or one already initialized; sets args.rank / args.world and,
    on GPU, args.device = cuda:LOCAL_RANK. Returns whether this call created the process group."""
    created = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        created = True
    args.rank, args.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if args.world > 1 and args.device.startswith("cuda"):
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', torch.cuda.current_device()))}"
    return created


def _inner(model):
    """The DLRM itself (inside the DistributedModelParallel of a sharded run)."""
    return getattr(model, "module", model)


def _all_sum(values: list[float], args) -> list[float]:
    if args.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _all_max(value: float, args) -> float:
    if args.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# --------------------------------------------------------------------------------------------- data
def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} not found; expected {what}")
    return path


def prepare_data(args, preset: RunPreset) -> Path:
    """The preprocessed directory for --data, generating / preprocessing it first if needed."""
    if args.data == "synthetic":
        # (the directory keeps its former name, `rows` = lines of the file: data generated before stays found)
        root = Path(args.data_dir or "data/synthetic") / f"criteo_{args.synthetic_samples}rows"
        out = root / "preprocessed"
        if not (out / "metadata.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            raw = root / "train.txt"
            config = preset.dataset()
            if not raw.is_file():
                progress.say(args, f"data: generating {args.synthetic_samples:,} synthetic Criteo-format samples "
                                   f"into {raw} (once; later runs reuse it)")
                tmp = root / "train.txt.tmp"
                stages = progress.StageProgress(args)
                write_criteo_tsv(tmp, args.synthetic_samples, config.table_sizes, seed=0, progress=stages)
                stages.close()
                os.replace(tmp, raw)
            _preprocess(args, preprocess_criteo_kaggle, raw, out, config=config, train_fraction=0.9,
                        val_fraction=0.1, overwrite=True)
        return out
    if args.data_dir is None:
        raise ValueError(f"--data {args.data} needs --data-dir (the directory of the raw files)")
    data_dir = _require(Path(args.data_dir), f"the {args.data} data directory")
    for candidate in (data_dir, data_dir / "preprocessed"):
        if (candidate / "metadata.json").is_file():
            return candidate
    out = data_dir / "preprocessed"
    if args.data == "criteo-kaggle":
        raw = _require(data_dir / "train.txt", "Criteo Kaggle's train.txt (from dac.tar.gz) in --data-dir")
        _preprocess(args, preprocess_criteo_kaggle, raw, out)
    elif args.data == "criteo-1tb":
        days = sorted((p for p in data_dir.glob("day_*") if p.is_file()),
                      key=lambda p: int("".join(c for c in p.name.split(".")[0] if c.isdigit()) or 0))
        if len(days) < 2:
            raise FileNotFoundError(f"{str(data_dir / 'day_*')!r}: found {len(days)} day files; expected the "
                                    "Criteo 1TB days day_0 .. day_23 (plain or .gz), at least two")
        _preprocess(args, preprocess_criteo_1tb, days, out)
    elif args.data == "avazu":
        raws = [data_dir / "train.csv", data_dir / "train.gz", data_dir / "train.csv.gz"]
        raw = next((p for p in raws if p.is_file()), None)
        if raw is None:
            raise FileNotFoundError(f"{str(raws[0])!r} not found; expected Avazu's train.csv (or train.gz) "
                                    "in --data-dir")
        _preprocess(args, preprocess_avazu, raw, out)
    return out


def _preprocess(args, fn, raw, out: Path, **kwargs) -> None:
    what = f"{len(raw)} day files" if isinstance(raw, list) else str(raw)
    progress.say(args, f"data: preprocessing {what} into {out} (once; later runs reuse it)")
    stages = progress.StageProgress(args)
    try:
        fn(raw, out, workers=args.workers, progress=stages, **kwargs)
    finally:
        stages.close()


def iterate(split: PreprocessedSplit, args, epoch: int, start: int, limit: int | None):
    batches = split.batches(args.batch_size, shuffle=True, seed=args.seed, epoch=epoch, start_batch=start,
                            limit_batches=limit)
    return batches


# --------------------------------------------------------------------------------------------- model
def build(args, preset: RunPreset, meta: dict, data_dir: Path):
    config = DLRMConfig(num_dense=len(meta["dense_names"]), cat_names=tuple(meta["cat_names"]),
                        table_sizes=tuple(meta["table_sizes"]), embedding_dim=args.embedding_dim,
                        dense_arch_layer_sizes=preset.dense_arch_layer_sizes,
                        over_arch_layer_sizes=preset.over_arch_layer_sizes, interaction=args.interaction,
                        dcn_num_layers=args.dcn_num_layers, dcn_low_rank_dim=args.dcn_low_rank_dim)
    id_freq = [torch.from_numpy(np.array(f, dtype=np.int64)) for f in load_id_freq(data_dir)]
    torch.manual_seed(args.seed)
    sparse_opt = SPARSE_OPTIMIZERS[args.optimizer](lr=args.lr)
    distributed = getattr(args, "world", 1) > 1
    storage = {}
    if args.table_dir is not None:
        Path(args.table_dir).mkdir(parents=True, exist_ok=True)
        # On --resume the previous run may have died with the files open: its last snapshots are intact and
        # the checkpoint names the one to continue from. Under torchrun each rank keeps its rows of each table
        # in its own file (<table>.rank<r>of<w>.cemb) behind --host-cache-mb of its own.
        storage["storage"] = cachedemb.FileStorage(args.table_dir, host_cache_bytes=args.host_cache_mb << 20,
                                                   recover=bool(args.resume))
    # Under torchrun the tables are built on the meta device: shard() then allocates only this rank's rows
    # (in memory, or in the rank's files), drawn as one process would draw them (on every rank, any world size).
    sparse_arch = (cachedemb.CachedEmbeddingBagCollection(config.tables(), cache_ratio=args.cache_ratio,
                                                          optimizer=sparse_opt, id_freq=id_freq, device="meta",
                                                          **storage)
                   if distributed else None)
    if distributed:
        storage = {}  # (in sparse_arch)
    sized = {}
    if args.cache_budget is not None:
        args.sizing_plan = size_caches(args, config, sparse_opt, data_dir)
        sized = {"cache_rows": args.sizing_plan.cache_rows}
    model = DLRM(config, cache_ratio=args.cache_ratio, optimizer=sparse_opt, id_freq=id_freq,
                 device=torch.device(args.device), sparse_arch=sparse_arch, **sized, **storage)
    if distributed:
        from cachedemb.distributed import shard

        model = shard(model)  # same seed on every rank: each keeps its rows; dense part in DDP
    dense_cls = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[args.dense_optimizer]
    dense_opt = dense_cls(_dense_parameters(model), lr=args.dense_lr)
    return model, dense_opt


def size_caches(args, config: DLRMConfig, sparse_opt, data_dir: Path) -> sizing.SizingPlan:
    """--cache-budget: rows per table from the first epoch's training batches, in training order, under the
    policy the run uses (LFU warm-started from the train counts; the look-ahead policy with --prefetch-depth)."""
    if getattr(args, "world", 1) > 1:
        raise ValueError("--cache-budget sizes one process's caches; under torchrun use --cache-ratio")
    depth = args.prefetch_depth
    horizon = args.prefetch_horizon if args.prefetch_horizon is not None else depth
    plan = sizing.plan(str(data_dir), args.cache_budget, config.tables(), optimizer=sparse_opt,
                       policy="lookahead" if depth > 0 else "lfu", depth=max(depth, 1), horizon=max(horizon, 1),
                       overlap=True,  # cachedemb.prefetch's default (a CUDA side stream, a host thread on CPU)
                       batch_size=args.batch_size, limit_batches=args.limit_batches, shuffle=True, seed=args.seed,
                       epoch=0, id_freq="auto")
    if not args.quiet and getattr(args, "rank", 0) == 0:
        print(plan.format_table(), file=sys.stderr, flush=True)  # stdout: the result only
    return plan


def _dense_parameters(model) -> list:
    inner = getattr(model, "module", model)  # shard() returns the model inside a DistributedModelParallel
    return inner.dense_parameters()


def save_checkpoint(path: Path, model, dense_opt, position: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_rng = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                 "has_gauss": int(has_gauss), "gauss": float(gauss)}  # plain state: loads with weights_only
    state = {"model": model.state_dict(), "dense_optimizer": dense_opt.state_dict(), "position": position,
             "rng": {"torch": torch.get_rng_state(), "numpy": numpy_rng, "python": random.getstate(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    cachedemb.save_checkpoint(state, path)  # atomic and durable: a kill mid-save keeps the previous one


def _trainer_state(dense_opt, position: dict) -> dict:
    return {"dense_optimizer": dense_opt.state_dict(), "position": position, "rng": torch.get_rng_state()}


def save_distributed_checkpoint(directory: Path, model, dense_opt, position: dict, args) -> None:
    """Every rank writes its rows (DCP) into a fresh step directory; rank 0 adds the trainer state, then points
    the `latest.dcp` symlink at it with one atomic rename (and drops the previous one): a job killed at any
    point still finds its previous checkpoint whole."""
    from cachedemb.modules.checkpoint import fsync_directory
    from cachedemb.distributed import checkpoint as dcp_ckpt

    link = directory / DIST_CHECKPOINT
    target = directory / f"{DIST_CHECKPOINT}.step{position['step']}"
    if link.is_symlink() and link.resolve() == target.resolve():  # saving the same step again: keep it whole
        target = target.with_name(target.name + ".again")
    if args.rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
    dist.barrier()
    dcp_ckpt.save_checkpoint(model, str(target))  # collective: returns when every rank's rows are written
    if args.rank == 0:
        cachedemb.save_checkpoint(_trainer_state(dense_opt, position), target / TRAINER)
        previous = link.resolve() if link.is_symlink() else None
        if link.exists() and not link.is_symlink():  # a plain directory written by an older recipe
            shutil.rmtree(link)
        pending = directory / (DIST_CHECKPOINT + ".link")
        with contextlib.suppress(FileNotFoundError):
            pending.unlink()
        os.symlink(target.name, pending)
        os.replace(pending, link)
        fsync_directory(directory)
        if previous is not None and previous != target.resolve():
            shutil.rmtree(previous, ignore_errors=True)
    dist.barrier()


def save_final_distributed(directory: Path, model, dense_opt, position: dict, args) -> None:
    """The end of a torchrun run with --table-dir: a sharded checkpoint `final.dcp` naming each rank file's
    snapshot (the rows stay in the files; gathering them would hold every table in rank 0's memory)."""
    from cachedemb.distributed import checkpoint as dcp_ckpt

    target = directory / FINAL_DIST
    if args.rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
    dist.barrier()
    dcp_ckpt.save_checkpoint(model, str(target))
    if args.rank == 0:
        cachedemb.save_checkpoint(_trainer_state(dense_opt, position), target / TRAINER)
    dist.barrier()


def resume(directory: Path, model, dense_opt, args) -> dict:
    """--resume from the newer of latest.pt (single-process) and latest.dcp (sharded), at any world size."""
    single, sharded = directory / CHECKPOINT, directory / DIST_CHECKPOINT
    newest = max((p for p in (single, sharded) if p.exists()), key=lambda p: p.stat().st_mtime, default=None)
    if newest is None:
        raise FileNotFoundError(f"--resume: neither {str(single)!r} nor {str(sharded)!r} found; expected a "
                                "checkpoint written with --checkpoint-every into --checkpoint-dir")
    if newest == single and args.world == 1:
        return load_checkpoint(single, model, dense_opt)
    from cachedemb.distributed import checkpoint as dcp_ckpt
    from cachedemb.distributed import load_full_state_dict

    if newest == single:
        state = cachedemb.load_checkpoint(single)
        load_full_state_dict(model, state["model"])
        trainer = {"dense_optimizer": state["dense_optimizer"], "position": state["position"],
                   "rng": state["rng"]["torch"]}
    else:
        if args.world == 1:
            dcp_ckpt.load_into_unsharded(model, str(sharded))
        else:
            dcp_ckpt.load_checkpoint(model, str(sharded))
        trainer = torch.load(sharded / TRAINER, map_location="cpu", weights_only=True)
    dense_opt.load_state_dict(trainer["dense_optimizer"])
    torch.set_rng_state(trainer["rng"])
    return trainer["position"]


def load_checkpoint(path: Path, model, dense_opt) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {str(path)!r} not found; expected a checkpoint written with "
                                "--checkpoint-every into --checkpoint-dir")
    state = cachedemb.load_checkpoint(path)  # torch.load(weights_only=True): unpickles no code
    model.load_state_dict(state["model"])
    dense_opt.load_state_dict(state["dense_optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    rng = state["rng"]["numpy"]
    np.random.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                         rng["gauss"]))
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["position"]


# --------------------------------------------------------------------------------------------- loops
class Logger:
    """CSV rows (and TensorBoard scalars when tensorboard is installed) under --log-dir."""

    def __init__(self, log_dir: str | None):
        self.file = self.writer = self.tb = None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(log_dir) / "train_log.csv", "a", newline="")
            self.writer = csv.writer(self.file)
            if self.file.tell() == 0:
                self.writer.writerow(["step", "epoch", "loss", "cache_hit_rate", "samples_per_s"])
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir)
            except ImportError:
                self.tb = None

    def log(self, step: int, epoch: int, loss: float, hit_rate: float, sps: float) -> None:
        if self.writer is not None:
            self.writer.writerow([step, epoch, f"{loss:.6f}", f"{hit_rate:.6f}", f"{sps:.1f}"])
            self.file.flush()
        if self.tb is not None:
            for k, v in (("train/loss", loss), ("train/cache_hit_rate", hit_rate), ("train/samples_per_s", sps)):
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


hit_rate = report.hit_rate  # (here since the recipe's first version)


def maybe_prefetch(batches, model, args):
    if args.prefetch_depth <= 0:
        return batches
    prefetch = getattr(cachedemb, "prefetch", None)
    if prefetch is None:
        try:
            prefetch = importlib.import_module("cachedemb.prefetch")
        except ImportError:
            prefetch = None
    if isinstance(prefetch, types.ModuleType):  # the submodule rather than its function
        prefetch = getattr(prefetch, "prefetch", None)
    if not callable(prefetch):
        warnings.warn("--prefetch-depth > 0 but this cachedemb has no prefetch(); training without it")
        return batches
    horizon = args.prefetch_horizon if args.prefetch_horizon is not None else args.prefetch_depth
    return prefetch(batches, [model], depth=args.prefetch_depth, horizon=horizon)


@torch.no_grad()
def evaluate(model: DLRM, split: PreprocessedSplit, args) -> dict:
    from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

    model.eval()
    auroc, accuracy = BinaryAUROC(), BinaryAccuracy()
    loss_sum, rows = 0.0, 0
    device = torch.device(args.device)
    world, rank = getattr(args, "world", 1), getattr(args, "rank", 0)
    batches = list(itertools.islice(split.batches(args.batch_size, limit_batches=args.eval_batches), rank, None,
                                    world))
    # Every rank runs the same number of forwards (the sharded lookup is collective): short ranks run empty ones.
    total = split.num_batches(args.batch_size)
    total = total if args.eval_batches is None else min(args.eval_batches, total)
    rounds = max(1, math.ceil(total / world))
    got_probs, got_labels = [], []
    for r in progress.bar(args, range(rounds), desc="eval", unit=" batches"):
        batch = batches[r] if r < len(batches) else None
        if batch is None:
            dense = torch.zeros(0, _inner(model).config.num_dense)
            sparse = torch.zeros(0, len(_inner(model).config.cat_names), dtype=torch.int64)
            labels_cpu = torch.zeros(0)
        else:
            dense, sparse, labels_cpu = batch.dense, batch.sparse, batch.labels
        labels = labels_cpu.to(device)
        logits = model(dense.to(device), sparse.to(device))
        loss_sum += float(nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum"))
        rows += labels.numel()
        got_probs.append(torch.sigmoid(logits).cpu())
        got_labels.append(labels_cpu.long())
    probs, labels = torch.cat(got_probs), torch.cat(got_labels)
    if world > 1:  # AUC needs every rank's predictions (as torchmetrics' own distributed sync gathers them)
        parts = [None] * world
        dist.all_gather_object(parts, (probs, labels))
        probs, labels = torch.cat([p for p, _ in parts]), torch.cat([lb for _, lb in parts])
        loss_sum, rows = _all_sum([loss_sum, rows], args)
        rows = int(rows)
    auroc.update(probs, labels)
    accuracy.update(probs, labels)
    model.train()
    if rows == 0:
        raise ValueError(f"the {split.split!r} split of {str(split.data_dir)!r} has no rows to evaluate")
    return {"auc": float(auroc.compute()), "logloss": loss_sum / rows, "accuracy": float(accuracy.compute()),
            "eval_rows": rows}


def train(model: DLRM, dense_opt, split: PreprocessedSplit, args, position: dict, logger: Logger) -> dict:
    device = torch.device(args.device)
    per_epoch = split.num_batches(args.batch_size)
    if args.limit_batches is not None:
        per_epoch = min(per_epoch, args.limit_batches)
    lines = progress.lines_on(args)  # no bar (stderr not a terminal): a progress line every --log-every steps
    world, rank = getattr(args, "world", 1), getattr(args, "rank", 0)
    step, samples, loss_sum, loss_n = position["step"], 0, 0.0, 0
    window_start, window_samples = time.perf_counter(), 0
    _inner(model).sparse_arch.reset_cache_stats()
    train_time, stopped = 0.0, False
    for epoch in range(position["epoch"], args.epochs):
        # `start`: global batches of this epoch already trained; each step takes `world` of them, rank r the
        # r-th (disjoint slices); a remainder smaller than the world is skipped so every rank steps equally.
        start = position["batch"] if epoch == position["epoch"] else 0
        local_steps = (per_epoch - start) // world
        source = iterate(split, args, epoch, start, local_steps * world)
        if world > 1:
            source = itertools.islice(source, rank, None, world)
        batches = maybe_prefetch(source, model, args)
        bar = progress.bar(args, batches, total=local_steps, desc=f"epoch {epoch + 1}/{args.epochs}",
                           unit=" steps")
        t0, first_step = time.perf_counter(), step
        for k, batch in enumerate(bar):
            consumed = start + (k + 1) * world
            scale = args.lr_schedule.scale(step + 1)
            set_learning_rates(_inner(model), dense_opt, args.dense_lr * scale, args.lr * scale)
            labels = batch.labels.to(device)
            logits = model(batch.dense.to(device), batch.sparse.to(device))
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()  # also steps the embeddings (fused sparse optimizer)
            dense_opt.step()
            step += 1
            samples += labels.numel()
            window_samples += labels.numel()
            # Summed on the device: a float() per step would be a host sync per step on a GPU.
            loss_sum, loss_n = loss_sum + loss.detach(), loss_n + 1
            if step % args.log_every == 0:
                loss_sum = float(loss_sum)
                now = time.perf_counter()
                sps = window_samples / max(now - window_start, 1e-9)
                rate = hit_rate(_inner(model).sparse_arch.cache_stats())
                logger.log(step, epoch, loss_sum / loss_n, rate, sps)
                bar.set_postfix_str(f"loss {loss_sum / loss_n:.4f}, hit rate {rate:.3f}, {sps:,.0f} samples/s")
                if lines:
                    print(progress.step_line(epoch, args.epochs, k + 1, local_steps, now - t0, loss_sum / loss_n,
                                             rate, sps), file=sys.stderr, flush=True)
                window_start, window_samples, loss_sum, loss_n = now, 0, 0.0, 0
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                nxt = {"epoch": epoch, "batch": consumed, "step": step}
                if consumed + world > per_epoch:
                    nxt = {"epoch": epoch + 1, "batch": 0, "step": step}
                if world > 1:
                    save_distributed_checkpoint(Path(args.checkpoint_dir), model, dense_opt, nxt, args)
                else:
                    save_checkpoint(Path(args.checkpoint_dir) / CHECKPOINT, model, dense_opt, nxt)
            if args.stop_after_steps is not None and step >= args.stop_after_steps:
                stopped = True
                break
        bar.close()
        train_time += time.perf_counter() - t0
        if lines:
            print(f"epoch {epoch + 1}/{args.epochs}: {step - first_step} steps in "
                  f"{progress.clock(time.perf_counter() - t0)}", file=sys.stderr, flush=True)
        if stopped:
            break
    stats = _inner(model).sparse_arch.cache_stats()
    # Job-wide figures: samples and cache counters summed over ranks, time of the slowest rank, the hit rate
    # weighted by each rank's distinct ids.
    rate, unique = hit_rate(stats), stats.get("unique", 0)
    samples, rows_in, unique, hits = _all_sum([samples, stats.get("rows_in", 0), unique,
                                               rate * unique if unique else 0.0], args)
    train_time = _all_max(train_time, args)
    return {"steps": step, "epochs": args.epochs, "train_samples": int(samples), "train_time_s": train_time,
            "samples_per_s": samples / train_time if train_time > 0 else float("nan"),
            "cache_hit_rate": rate if world == 1 else (hits / unique if unique else float("nan")),
            "cache_rows_in": int(rows_in), "stopped_early": stopped, "world_size": world}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    preset: RunPreset = args.preset
    random.seed(args.seed)
    np.random.seed(args.seed)
    created = init_distributed(args)
    try:
        return _run(args, preset)
    finally:
        if created:
            dist.destroy_process_group()


def _run(args, preset: RunPreset) -> dict:
    if args.rank == 0:
        data_dir = prepare_data(args, preset)
    if args.world > 1:
        dist.barrier()  # rank 0 generated / preprocessed the data
        data_dir = prepare_data(args, preset)
    meta = load_metadata(data_dir)
    train_split, val_split = PreprocessedSplit(data_dir, "train"), PreprocessedSplit(data_dir, "val")
    model, dense_opt = build(args, preset, meta, data_dir)
    try:
        return _train_and_evaluate(args, model, dense_opt, train_split, val_split)
    finally:
        if args.table_dir is not None:
            _inner(model).sparse_arch.close()  # commits the tables' files and releases them


def _train_and_evaluate(args, model, dense_opt, train_split, val_split) -> dict:
    position = {"epoch": 0, "batch": 0, "step": 0}
    if args.resume:
        position = resume(Path(args.checkpoint_dir), model, dense_opt, args)
    logger = Logger(args.log_dir)
    try:
        metrics = train(model, dense_opt, train_split, args, position, logger)
    finally:
        logger.close()
    if args.checkpoint_dir and not metrics["stopped_early"]:
        final_position = {"epoch": args.epochs, "batch": 0, "step": metrics["steps"]}
        if args.world > 1 and args.table_dir is not None:  # the rows stay in the ranks' files
            save_final_distributed(Path(args.checkpoint_dir), model, dense_opt, final_position, args)
        elif args.world > 1:  # the unsharded state_dict, as a single-process run writes it
            from cachedemb.distributed import gather_full_state_dict

            full = gather_full_state_dict(model)
            if args.rank == 0:
                Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
                cachedemb.save_checkpoint({"model": full, "dense_optimizer": dense_opt.state_dict(),
                                           "position": final_position}, Path(args.checkpoint_dir) / FINAL)
        else:
            save_checkpoint(Path(args.checkpoint_dir) / FINAL, model, dense_opt, final_position)
    if not metrics["stopped_early"]:
        metrics.update(evaluate(model, val_split, args))
    metrics.update({"data": args.data, "cache_ratio": args.cache_ratio, "embedding_dim": args.embedding_dim,
                    "batch_size": args.batch_size, "device": args.device})
    plan = getattr(args, "sizing_plan", None)
    if plan is not None:  # --cache-budget: what the sizing predicted, beside what training measured
        metrics.update({"cache_ratio": round(sum(plan.cache_rows.values()) / sum(t.spec.num_embeddings
                                                                                  for t in plan.tables), 6),
                        "cache_budget_bytes": plan.budget_bytes, "cache_budget_used": plan.budget_used,
                        "cache_rows": [g.cache_rows for g in plan.groups],
                        "predicted_cache_hit_rate": round(plan.hit_rate, 6),
                        "predicted_pcie_bytes_per_step": round(plan.pcie_bytes_per_step, 1)})
    if not math.isnan(metrics["cache_hit_rate"]):
        metrics["cache_hit_rate"] = round(metrics["cache_hit_rate"], 6)
    if args.rank == 0:
        report.publish(metrics, args.metrics_file)
    return metrics


if __name__ == "__main__":
    main()
