"""Two gloo ranks sharing one device train a row-wise sharded CachedEmbeddingBag; each step's outputs and the
gathered table must equal one process trained on both ranks' batches. Prints one JSON object.

    python scripts/gpu_two_rank.py --device cuda --out two_rank.json     # both ranks on cuda:0
    python scripts/gpu_two_rank.py --device cpu                          # the same job on CPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROWS, DIM, BAGS, POOL = 5000, 16, 32, 6


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, ROWS, (world * BAGS * POOL,), generator=g)
    target = torch.randn(world * BAGS, DIM, generator=g)
    return ids, target


def _job(rank: int, world: int, device: str, steps: int) -> dict:
    import cachedemb
    from cachedemb.distributed import TableSharding, gather_full_state_dict, shard

    dev = torch.device(device)
    torch.manual_seed(0)
    weight = torch.randn(ROWS, DIM)

    def make():
        m = cachedemb.CachedEmbeddingBag(ROWS, DIM, mode="sum", cache_rows=400, device=dev,
                                         optimizer=cachedemb.optim.SGD(lr=0.1), _weight=weight.clone())
        m._shard_local = True  # the single-process reference runs inside the job
        return m

    reference, model = make(), shard(make(), plan={"": TableSharding.row_wise(ROWS, world)})
    offsets = torch.arange(BAGS, device=dev) * POOL
    worst = 0.0
    for step in range(steps):
        ids, target = _batch(step, world)
        local = ids[rank * BAGS * POOL:(rank + 1) * BAGS * POOL].to(dev)
        out = model(local, offsets)
        ref = reference(ids.to(dev), torch.arange(world * BAGS, device=dev) * POOL)
        mine = ref[rank * BAGS:(rank + 1) * BAGS]
        worst = max(worst, float((out - mine).detach().abs().max()))
        (out * target[rank * BAGS:(rank + 1) * BAGS].to(dev)).sum().backward()
        (ref * target.to(dev)).sum().backward()
    full = gather_full_state_dict(model)
    table_diff = None
    if rank == 0:
        expected = reference.state_dict()["weight"].cpu()
        table_diff = float((full["weight"].cpu() - expected).abs().max())
    return {"rank": rank, "max_output_diff": worst, "max_table_diff": table_diff}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds the ranks may take")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (use --device cpu)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cachedemb.distributed.testing import run_spawned

    t0 = time.perf_counter()
    report = {"benchmark": "two_rank_gloo", "device": args.device, "world": 2, "rows": ROWS, "dim": DIM}
    try:
        ranks = run_spawned(_job, 2, args.device, args.steps, timeout_s=args.timeout)
        diff = max(r["max_output_diff"] for r in ranks)
        table = next(r["max_table_diff"] for r in ranks if r["rank"] == 0)
        report.update(ranks=ranks, equal=diff <= 1e-5 and table <= 1e-5)
    except Exception as e:  # noqa: BLE001 -- the failure is the result, reported in the JSON
        report.update(equal=False, error=f"{type(e).__name__}: {e}"[-4000:])
    report["seconds"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
