#!/usr/bin/env python
"""Per-step process CPU time (1 torch thread) of CachedEmbeddingBag + fused SGD at several cache sizes and of
nn.EmbeddingBag(sparse) + torch SGD: on a shared box, CPU time is less disturbed by other processes than wall time.

    OMP_NUM_THREADS=1 python scripts/bench_step_cpu_time.py ROWS CACHE_ROWS[,CACHE_ROWS...] [OUT.json]
"""
import json, sys, time, gc, statistics, torch, cachedemb
from torch import nn
from cachedemb.traces import zipf_trace
torch.set_num_threads(1)
rows = int(sys.argv[1]); caches = [int(c) for c in sys.argv[2].split(",")]
trace = zipf_trace(rows, 4096 * 26, 6, 1.05, seed=0)
batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
off = torch.arange(4096) * 26
out = {"num_rows": rows, "dim": 64, "batch": "4096 x 26 zipf 1.05", "warmup": 2, "steps": 4, "torch_threads": 1, "runs": []}
def steps(fn):
    ts = []
    for i, b in enumerate(batches):
        t = time.process_time(); fn(b); d = time.process_time() - t
        if i >= 2: ts.append(d)
    return statistics.median(ts)
for c in caches:
    emb = cachedemb.CachedEmbeddingBag(rows, 64, mode="sum", cache_rows=c, optimizer=cachedemb.optim.SGD(lr=0.01), device="cpu")
    s = steps(lambda b: emb(b, off).sum().backward())
    st = emb.cache_stats()
    out["runs"].append({"cache_rows": c, "cached_step_cpu_s": s, "hit_rate": st["hits"] / st["unique"], "seconds": st["seconds"]})
    print(out["runs"][-1], flush=True)
    del emb; gc.collect()
ref = nn.EmbeddingBag(rows, 64, mode="sum", sparse=True)
opt = torch.optim.SGD(ref.parameters(), lr=0.01)
def rstep(b):
    opt.zero_grad(); ref(b, off).sum().backward(); opt.step()
out["reference_step_cpu_s"] = steps(rstep)
for r in out["runs"]:
    r["over_reference"] = r["cached_step_cpu_s"] / out["reference_step_cpu_s"]
print(json.dumps(out, indent=1))
if len(sys.argv) > 3:
    json.dump(out, open(sys.argv[3], "w"), indent=1)
