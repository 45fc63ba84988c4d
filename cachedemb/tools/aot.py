"""Record the Triton launches the library makes and compile them for a GPU target, without a GPU.

Two stages, in two processes, so no kernel signature is written down anywhere but in its kernel file:

1. record (any process; under TRITON_INTERPRET=1 on CPU, or on a GPU): inside `LaunchRecorder`, every
   `kernel[grid](...)` launch of a kernel defined under `cachedemb.` is turned into a `KernelVariant` — each
   argument's type as Triton's JIT would specialize it ("*bf16", "i32", "i64", "fp32"; an int equal to 1 and
   None become constexprs unless the argument is in `do_not_specialize`), the arguments it would mark
   divisible by 16, the constexpr values and the launch options (num_warps, ...). Launches are deduplicated.
2. compile (`compile_variants`, a subprocess without TRITON_INTERPRET, so `@triton.jit` gives JITFunctions):
   each variant is imported by module and name and built with `triton.compile(ASTSource(...),
   target=GPUTarget("cuda", arch, 32))` (ttir -> ttgir -> ptx -> cubin, with the ptxas shipped in Triton); the
   cubin's registers, stack, local and shared memory come from `cuobjdump --dump-resource-usage`, spill bytes
   from `ptxas -v` where there is a stack frame, vector load/store counts from the PTX. A variant recorded
   from an older version of its kernel fails with the argument lists side by side.

The launchers pick some constexprs by device (interpreter-sized blocks, BLOCK_L, num_warps and SOFT_RTNE differ
on CPU): a recording made on CPU compiles the CPU launches; one made on a GPU, exactly what runs there.

    with LaunchRecorder() as rec:
        run_the_workload()
    results = compile_variants(rec.variants, archs=(90, 80))
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

DIVISIBILITY = 16  # what Triton's "D" specialization attribute asserts


@dataclass(frozen=True, eq=False)
class KernelVariant:
    """One compiled form of a kernel: what Triton's JIT keys its cache on, minus the device."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]  # (argument, type) in order; "constexpr" for constexprs
    constexprs: tuple[tuple[str, object], ...]  # (argument, JSON value); tl.dtype as {"dtype": name}
    divisible: tuple[str, ...]  # arguments Triton would mark divisible by 16 (pointer alignment, ints)
    options: tuple[tuple[str, object], ...]  # launch options as passed (num_warps, num_stages, ...)

    def _key(self) -> str:
        return json.dumps([self.module, self.name, self.signature, self.constexprs, self.divisible, self.options])

    def __eq__(self, other) -> bool:
        return isinstance(other, KernelVariant) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def kernel(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def label(self) -> str:
        """Short and unique: `name[CONSTEXPR=v,...](arg types)` + the options passed; `%` marks an argument
        specialized as divisible by 16."""
        consts = ",".join(f"{k}={_short(v)}" for k, v in self.constexprs)
        types = ",".join(("%" if k in self.divisible else "") + t for k, t in self.signature if t != "constexpr")
        opts = "".join(f" {k}={v}" for k, v in self.options)
        return f"{self.name}[{consts}]({types}){opts}"

    def to_json(self) -> dict:
        return {"module": self.module, "name": self.name, "signature": dict(self.signature),
                "constexprs": dict(self.constexprs), "divisible_by_16": list(self.divisible),
                "options": dict(self.options), "label": self.label}

    @classmethod
    def from_json(cls, d: dict) -> "KernelVariant":
        return cls(d["module"], d["name"], tuple(d["signature"].items()), tuple(d["constexprs"].items()),
                   tuple(d["divisible_by_16"]), tuple(d["options"].items()))


def _short(v) -> str:
    return v["dtype"] if isinstance(v, dict) else str(v)


# ----------------------------------------------------------------------------------------------- recording
def _base_jit(obj):
    """The JITFunction / InterpretedFunction under autotune / heuristics wrappers, or None."""
    from triton.runtime.jit import KernelInterface

    while isinstance(obj, KernelInterface):
        if inspect.isfunction(getattr(obj, "fn", None)):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def _no_specialize(jit_obj, names: list[str]) -> tuple[set[str], set[str]]:
    kwargs = getattr(jit_obj, "kwargs", {})  # InterpretedFunction keeps the decorator's arguments here
    found = []
    for attr in ("do_not_specialize", "do_not_specialize_on_alignment"):
        given = getattr(jit_obj, attr, None) or kwargs.get(attr) or []
        found.append({names[x] if isinstance(x, int) else x for x in given})
    return found[0], found[1]


def _constexpr_json(value):
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"constexpr value {value!r} of type {type(value).__name__} cannot be recorded")


def _constexpr_value(value):
    import triton.language as tl

    return tl.dtype(value["dtype"]) if isinstance(value, dict) else value


def variant_of_launch(jit_obj, args: tuple, kwargs: dict) -> KernelVariant:
    """The variant a `jit_obj[grid](*args, **kwargs)` launch compiles to, specialized as Triton's binder does
    (`create_function_from_signature` in triton/runtime/jit.py)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam

    fn = jit_obj.fn
    sig = inspect.signature(fn)
    names = list(sig.parameters)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
    dns, dns_oa = _no_specialize(jit_obj, names)
    signature, constexprs, divisible = [], [], []
    for i, (name, param) in enumerate(sig.parameters.items()):
        kp = KernelParam(i, param, name in dns, name in dns_oa)
        value = bound.arguments[name]
        if kp.is_constexpr:
            ty, attr = "constexpr", None
        else:
            ty, attr = native_specialize_impl(BaseBackend, value, kp.is_const, not kp.do_not_specialize,
                                              not kp.do_not_specialize_on_alignment)
            if kp.annotation_type:  # an annotated scalar keeps its type; floats and bools never specialize
                unspecialized = kp.annotation_type == "u1" or kp.annotation_type[:2] in ("fp", "bf")
                ty, attr = kp.annotation_type, (None if unspecialized or kp.do_not_specialize else attr)
        signature.append((name, ty))
        if ty == "constexpr":
            constexprs.append((name, _constexpr_json(value)))
        elif attr and "D" in attr:
            divisible.append(name)
    return KernelVariant(fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), tuple(divisible),
                         options)


class LaunchRecorder:
    """While active, records every launch of a Triton kernel whose module starts with one of `prefixes`
    (the kernel still runs). `variants`: distinct variants in first-launch order; `launches`: counts."""

    _active: "LaunchRecorder | None" = None

    def __init__(self, prefixes: tuple[str, ...] = ("cachedemb.",)):
        self.prefixes = prefixes
        self.launches: dict[KernelVariant, int] = {}
        self._lock = threading.Lock()
        self._patched: list[tuple[type, object]] = []

    @property
    def variants(self) -> list[KernelVariant]:
        return list(self.launches)

    @property
    def kernels(self) -> set[str]:
        return {v.kernel for v in self.launches}

    def _record(self, jit_obj, args, kwargs) -> None:
        if not jit_obj.fn.__module__.startswith(self.prefixes):
            return
        variant = variant_of_launch(jit_obj, args, kwargs)
        with self._lock:
            self.launches[variant] = self.launches.get(variant, 0) + 1

    def __enter__(self) -> "LaunchRecorder":
        from triton.runtime.jit import JITFunction

        if LaunchRecorder._active is not None:
            raise RuntimeError("a LaunchRecorder is already active; recorders do not nest")
        classes = [JITFunction]
        with contextlib.suppress(ImportError):
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        for cls in classes:
            real = cls.__dict__["run"]

            def run(jit_obj, *args, grid, warmup, _real=real, **kwargs):
                if not warmup:
                    self._record(jit_obj, args, kwargs)
                return _real(jit_obj, *args, grid=grid, warmup=warmup, **kwargs)

            self._patched.append((cls, real))
            cls.run = run
        LaunchRecorder._active = self
        return self

    def __exit__(self, *exc) -> None:
        for cls, real in self._patched:
            cls.run = real
        self._patched.clear()
        LaunchRecorder._active = None


WORKLOAD_DIMS = (7, 129)  # one D-block below 128, one past it (neither divisible by 16)
WORKLOAD_MODES = ("sum", "mean", "max")
WORKLOAD_OPTIMIZERS = (None, "SGD", "Adagrad", "RowWiseAdagrad", "Adam")
HOT_LOOKUPS = 260  # a last batch of >= 256 lookups per module: the GPU backward's chunked variants


def library_workload(device="cpu", dims=WORKLOAD_DIMS, dtypes=("float32", "bfloat16", "float16"), rows: int = 48,
                     cache_rows: int = 4, bags: int = 3, bag_len: int = 4, steps: int = 2,
                     seed: int = 0) -> None:
    """Drive every launch path of the library: a forward + backward for each (mode, optimizer) pair
    (optimizer=None leaves the id-space gradient of `weight`), cycling the table dtype, the dim, per-sample
    weights (sum) and padding_idx so each meets every mode; `steps` batches each (the last with HOT_LOOKUPS
    more lookups of one id), with more distinct ids than
    the cache holds (evictions, rows served beyond the cache); the prefetch pipeline in order and overlapped; the
    other eviction policies (each built-in one has its own scoring variant); and
    `kernels.sparse_update`, a public op the module does not call. On CPU it needs TRITON_INTERPRET=1 and
    CACHEDEMB_BACKEND=triton set before triton is imported."""
    import itertools

    import torch

    import cachedemb
    from cachedemb import kernels, optim

    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)

    def batch(hot: int = 0):
        """`hot` more lookups of one id in a last bag: from 256 lookups on, the GPU backward launches its
        chunked variants (a hot id's long group split, see kernels/bag_backward.py)."""
        ids = torch.randint(0, rows, (bags * bag_len,), generator=gen)
        ids = torch.cat([ids, torch.full((hot,), int(ids[0]))])
        offsets = torch.arange(bags + (hot > 0)) * bag_len
        return ids.to(device), offsets.to(device)

    def step(emb, ids, offsets, psw=None):
        emb(ids, offsets, per_sample_weights=psw).float().square().sum().backward()

    for i, (mode, opt) in enumerate(itertools.product(WORKLOAD_MODES, WORKLOAD_OPTIMIZERS)):
        dtype, dim = getattr(torch, dtypes[i % len(dtypes)]), dims[i // len(dtypes) % len(dims)]
        spec = getattr(optim, opt)(lr=0.01) if opt else None
        emb = cachedemb.CachedEmbeddingBag(rows, dim, mode=mode, cache_rows=cache_rows, device=device,
                                           dtype=dtype, optimizer=spec, padding_idx=3 if i % 3 else None)
        for s in range(steps):
            ids, offsets = batch(hot=HOT_LOOKUPS if s == steps - 1 else 0)
            psw = None
            if mode == "sum" and i % 2 == 0:
                psw = torch.rand(ids.numel(), generator=gen).to(device=device, dtype=dtype).requires_grad_(i % 4 == 0)
            step(emb, ids, offsets, psw)
    for overlap in (False, True):
        emb = cachedemb.CachedEmbeddingBag(rows, dims[0], mode="sum", cache_rows=4 * cache_rows, device=device,
                                           optimizer=optim.Adam(lr=0.01))
        for ids, offsets in cachedemb.prefetch([batch() for _ in range(4)], [emb], depth=2, horizon=4,
                                               overlap=overlap):
            step(emb, ids, offsets)
    for policy in ("lru", "lookahead"):  # every slot-score kind; lookahead over two tables reads their ranks
        emb = cachedemb.CachedEmbeddingBag(rows, dims[0], mode="sum", cache_rows=cache_rows, device=device,
                                           optimizer=optim.SGD(lr=0.01), policy=policy)
        if policy == "lookahead":
            emb.cache.set_tables([0, rows // 3])
        for _ in range(steps):
            step(emb, *batch())
    n = bags * bag_len
    for kind in (kernels.SGD, kernels.ADAGRAD, kernels.ROWWISE_ADAGRAD, kernels.ADAM):
        rule = kernels.UpdateRule(kind, lr=0.01, eps=1e-8, beta1=0.9, beta2=0.999, step_size=0.01)
        dim = dims[-1]
        table = torch.randn(rows, dim, generator=gen).to(device)
        width = 1 if kind == kernels.ROWWISE_ADAGRAD else dim
        states = [torch.zeros(rows, width, device=device) for _ in range(rule.num_states)]
        loc_u = torch.randperm(rows, generator=gen)[:n].to(device)
        grad_u = torch.randn(n, dim, generator=gen).to(device)
        kernels.sparse_update(table, states, loc_u, grad_u, torch.tensor([n - 2], device=device), rule)
    # the CUDA rules' fixed launch sequence (on CPU: the sync-free mode): unvalidated input repaired on the device,
    # the gated ranking and rebuild, the window batches' lookup-only path, 2-D input and include_last_offset
    import os

    saved = os.environ.get("CACHEDEMB_SYNC_FREE")
    os.environ["CACHEDEMB_SYNC_FREE"] = "1"
    try:
        for policy, kwargs in (("lfu", {}), ("lookahead", {"include_last_offset": True})):
            emb = cachedemb.CachedEmbeddingBag(rows, dims[0], mode="sum", cache_rows=cache_rows, device=device,
                                               optimizer=optim.Adagrad(lr=0.01), validate_inputs=False,
                                               policy=policy, **kwargs)
            for _ in range(steps + 1):
                step(emb, *batch())
            step(emb, torch.randint(0, rows, (bags, bag_len), generator=gen).to(device), None)
        emb = cachedemb.CachedEmbeddingBag(rows, dims[0], mode="mean", cache_rows=4 * cache_rows, device=device,
                                           optimizer=optim.SGD(lr=0.01), validate_inputs=False)
        for ids, offsets in cachedemb.prefetch([batch() for _ in range(4)], [emb], depth=2, horizon=4):
            step(emb, ids, offsets)
        # a batch of hundreds of distinct ids: the placement's widest blocks (256 on GPUs) and a three-pair row
        # move with the counts added (Adam: the row and two states), as a production batch launches them
        emb = cachedemb.CachedEmbeddingBag(4096, dims[0], mode="sum", cache_rows=256, device=device,
                                           optimizer=optim.Adam(lr=0.01), validate_inputs=False)
        for _ in range(2):
            ids = torch.randperm(4096, generator=gen)[:384]
            step(emb, ids.to(device), torch.arange(0, 384, 8).to(device))
    finally:
        if saved is None:
            os.environ.pop("CACHEDEMB_SYNC_FREE", None)
        else:
            os.environ["CACHEDEMB_SYNC_FREE"] = saved
    # victim selection over a cache larger than one GPU block (the module's caches above are a few slots)
    kernels.victim_select(torch.randperm(3000, generator=gen).to(device), 7)
    keys = torch.arange(0, 2 * rows, 2, device=device)
    kernels.slot_lookup(keys, torch.arange(rows, device=device), torch.arange(n, device=device),
                        torch.tensor([n - 1], device=device))
    # the id index and the multi-tensor row copy, which the CPU host-count path no longer reaches (it keeps a
    # dense id -> slot map) but the CUDA caches use
    from cachedemb.kernels import id_index

    index = id_index.new_index(rows, device)
    ids = torch.randperm(rows, generator=gen)[:n].to(device)
    count = torch.tensor([n - 1], device=device)
    id_index.index_insert(index, ids, torch.arange(n, device=device), count)
    id_index.index_lookup(index, ids, count)
    id_index.index_delete(index, ids[: n // 2], torch.tensor([n // 2], device=device))
    src, dst = torch.randn(rows, dims[0], generator=gen).to(device), torch.zeros(rows, dims[0], device=device)
    freq_src, freq_dst = torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.int64, device=device)
    kernels.row_copy_many([kernels.RowCopy(src, ids, dst, ids), kernels.RowCopy(freq_src, ids, freq_dst, ids)],
                          count)
    _row_moves(device, gen)
    # every slot's score in one launch, per built-in kind (with table ranks for lookahead): the window plans rank
    # with it where the victim pool scores the whole cache, which the per-batch CUDA path (pool_rank) never does
    slots = torch.randperm(3000, generator=gen).to(device)
    freq, last_use = torch.randint(0, 50, (3000,), generator=gen).to(device), torch.arange(3000, device=device)
    next_use, protected = torch.full((3000,), -1, device=device), torch.zeros(3000, dtype=torch.bool, device=device)
    for kind in kernels.SCORE_KINDS:
        tables = ((torch.tensor([0, 1500], device=device), torch.tensor([0, 1], device=device))
                  if kind == kernels.SCORE_LOOKAHEAD else None)
        kernels.slot_score_triton(kind, slots, freq, last_use, next_use, protected, tables)


ROW_MOVE_SHAPES = ((64, "float32"), (128, "bfloat16"), (128, "float32"))  # 256 B and 512 B rows


def _row_moves(device, gen) -> None:
    """An admission's row move at the row sizes the GPU benchmarks move (256 B and 512 B rows), split (the
    default) and fused, with one pair (SGD) and three (Adam: the row and two states, the counts plus the batch's
    lookups)."""
    import itertools

    import torch

    row_copy = importlib.import_module("cachedemb.kernels.row_copy")  # the package exports a function row_copy

    k, slots, rows = 24, 64, 200
    for (dim, dtype), n_pairs in itertools.product(ROW_MOVE_SHAPES, (1, 3)):
        widths = (dim, dim, 1)[:n_pairs]
        pairs = [(torch.zeros(slots, w, device=device).to(getattr(torch, dtype) if i == 0 else torch.float32),
                  torch.randn(rows, w, generator=gen).to(getattr(torch, dtype) if i == 0 else torch.float32)
                  .to(device)) for i, w in enumerate(widths)]
        victims = torch.randperm(slots, generator=gen)[:k].to(device)
        ids = torch.randperm(rows, generator=gen)[: 3 * k].to(device)  # k victims' ids, then 2k misses
        dest = torch.cat([victims, torch.full((k,), -1, device=device, dtype=torch.int64)])
        n_admit, n_miss = torch.tensor([k], device=device), torch.tensor([2 * k], device=device)
        add = torch.ones(2 * k, dtype=torch.int64, device=device)
        freq_slot, freq_host = torch.zeros(slots, dtype=torch.int64, device=device), torch.arange(rows, device=device)
        for fn in (row_copy.row_move_split_triton, row_copy.row_move_fused_triton):
            fn(pairs, freq_slot, freq_host, victims, n_admit, ids[:k], ids[:k], ids[k:], dest, n_miss,
               add if n_pairs > 1 else None)


def launched_kernels(package: str = "cachedemb.kernels") -> set[str]:
    """`module.name` of every @triton.jit kernel defined in `package` that some module of it launches
    (`name[grid](...)`): what a recording must cover."""
    pkg = importlib.import_module(package)
    modules = [importlib.import_module(f"{package}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
    importlib.import_module(f"{package}.lazy_triton").load()  # the kernels' JITFunctions in place of stand-ins
    source = "\n".join(inspect.getsource(m) for m in modules)
    found = set()
    for mod in modules:
        for attr, obj in vars(mod).items():
            jit = _base_jit(obj)
            if jit is not None and jit.fn.__module__ == mod.__name__ and re.search(rf"\b{attr}\s*\[", source):
                found.add(f"{mod.__name__}.{jit.fn.__name__}")
    return found


# ----------------------------------------------------------------------------------------------- compiling
def toolchain_missing() -> str | None:
    """Why variants cannot be compiled here (no Triton NVIDIA backend, no ptxas/cuobjdump), or None."""
    try:
        from triton import knobs
        import triton.backends.nvidia.compiler  # noqa: F401

        knobs.nvidia.ptxas.path, knobs.nvidia.cuobjdump.path  # noqa: B018 -- raise when not found
    except (ImportError, RuntimeError, AttributeError) as e:
        return f"Triton's NVIDIA backend is unavailable: {type(e).__name__}: {e}"
    return None


_RESOURCE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")
_VECTOR = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld|st)\.global\.(?:[\w:]+\.)*?v(\d)\.", re.M)
_SCALAR = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld|st)\.global\.", re.M)


def ptx_memory_ops(ptx: str) -> dict[str, int]:
    """Global loads/stores in the PTX: totals and how many are 2- / 4-wide vectors."""
    counts = {"ld_global": 0, "ld_global_v2": 0, "ld_global_v4": 0,
              "st_global": 0, "st_global_v2": 0, "st_global_v4": 0}
    for op in _SCALAR.findall(ptx):
        counts[f"{op}_global"] += 1
    for op, width in _VECTOR.findall(ptx):
        key = f"{op}_global_v{width}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def resource_usage(cubin: bytes, kernel_name: str) -> dict[str, int]:
    """Registers, stack (spills), local and shared memory bytes of one kernel in a cubin (cuobjdump)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                             check=True, capture_output=True, text=True).stdout
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"Function {re.escape(kernel_name)}\s*:", line):
            fields = dict(_RESOURCE.findall(" ".join(lines[i + 1:i + 2])))
            return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
                    "local_bytes": int(fields["LOCAL"]), "shared_bytes": int(fields["SHARED"])}
    raise RuntimeError(f"cuobjdump lists no function {kernel_name!r}:\n{out}")


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_for(arch: int) -> str:
    """The ptxas Triton itself assembles sm_<arch> with: Triton 3.9 uses its newer `ptxas-blackwell` from sm_90 on
    (3.7 from sm_100), and the PTX it emits then has an ISA version the older bundled ptxas rejects."""
    from triton import knobs

    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return knobs.nvidia.ptxas.path
    return get_ptxas(arch).path


def ptxas_spills(ptx: str, arch: int) -> dict[str, int]:
    """Spill stores / loads of the kernel in `ptx` as `ptxas -v` reports them (a stack frame alone is no spill)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [ptxas_for(arch), "-v", f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o",
               str(Path(tmp) / "kernel.o")]
        # Triton 3.7's make_cubin adds --regAllocOptLevel=2 (it changes allocation); older ptxas may lack it
        proc = subprocess.run(cmd[:1] + ["--regAllocOptLevel=2"] + cmd[1:], capture_output=True, text=True)
        if proc.returncode != 0:
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
        log = proc.stderr
    match = _PTXAS.search(log)
    if match is None:
        raise RuntimeError(f"no resource line in the ptxas log:\n{log}")
    return {"spill_store_bytes": int(match[2]), "spill_load_bytes": int(match[3])}


def compile_variant(variant: KernelVariant, arch: int) -> dict:
    """Compile one variant for sm_<arch> in this process (TRITON_INTERPRET must be unset)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module = importlib.import_module(variant.module)
    importlib.import_module("cachedemb.kernels.lazy_triton").load()  # JITFunctions in place of the stand-ins
    fn = _base_jit(getattr(module, variant.name))
    if not isinstance(fn, JITFunction):
        raise TypeError(f"{variant.kernel} is {type(fn).__name__}, not a JITFunction: unset TRITON_INTERPRET")
    recorded = [name for name, _ in variant.signature]
    if recorded != fn.arg_names:
        raise TypeError(f"{variant.kernel}: recorded arguments {recorded} differ from the kernel's "
                        f"{fn.arg_names}: record the launches again")
    index = {name: (i,) for i, name in enumerate(fn.arg_names)}
    src = ASTSource(fn, dict(variant.signature),
                    {index[k]: _constexpr_value(v) for k, v in variant.constexprs},
                    {index[k]: [["tt.divisibility", DIVISIBILITY]] for k in variant.divisible})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(variant.options))
    usage = resource_usage(compiled.asm["cubin"], compiled.metadata.name)
    if usage["stack_bytes"] or usage["local_bytes"]:  # a stack frame may be a spill or not: ask ptxas
        usage.update(ptxas_spills(compiled.asm["ptx"], arch))
    else:
        usage.update(spill_store_bytes=0, spill_load_bytes=0)
    return {**usage, **ptx_memory_ops(compiled.asm["ptx"])}


def _compile_file(job_path: str, out_path: str) -> None:
    """Worker entry: compile each {"variant", "arch"} of a JSON list; every result (or error) to out_path."""
    jobs = json.loads(Path(job_path).read_text())
    results = []
    for job in jobs:
        variant = KernelVariant.from_json(job["variant"])
        row = {"kernel": variant.kernel, "label": variant.label, "arch": f"sm_{job['arch']}",
               "variant": variant.to_json()}
        try:
            row.update(compile_variant(variant, job["arch"]))
            row["spills"] = row["spill_store_bytes"] > 0 or row["spill_load_bytes"] > 0
        except Exception as e:  # noqa: BLE001 -- a compile error is a result, reported per variant
            row["error"] = f"{type(e).__name__}: {e}"[:4000]
        results.append(row)
    Path(out_path).write_text(json.dumps(results))


def compile_variants(variants, archs=(90, 80), jobs: int = 2) -> list[dict]:
    """Compile every variant for every arch in `jobs` subprocesses without TRITON_INTERPRET. One row per
    (variant, arch), in input order: kernel, label, arch, variant, and either registers, stack_bytes,
    local_bytes, shared_bytes, spill_store_bytes, spill_load_bytes, spills and the PTX global load/store counts,
    or error."""
    work = [{"variant": v.to_json(), "arch": int(a)} for v in variants for a in archs]
    if not work:
        return []
    jobs = max(1, min(jobs, len(work)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the caller's cachedemb, wherever it is
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(jobs):
            job_path, out_path = Path(tmp) / f"jobs{i}.json", Path(tmp) / f"out{i}.json"
            job_path.write_text(json.dumps(work[i::jobs]))
            cmd = [sys.executable, "-m", "cachedemb.tools.aot", "compile", str(job_path), str(out_path)]
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True), out_path))
        shards = []
        for proc, out_path in procs:
            log, _ = proc.communicate()
            if proc.returncode != 0 or not out_path.exists():
                raise RuntimeError(f"compile worker exited with {proc.returncode}:\n{log[-4000:]}")
            shards.append(json.loads(out_path.read_text()))
    ordered = []
    for i in range(len(work)):  # undo the round-robin split
        ordered.append(shards[i % jobs][i // jobs])
    return ordered


def record_library_launches(**workload) -> list[KernelVariant]:
    """The variants `library_workload(**workload)` launches: on the GPU where CUDA exists (what really runs
    there), else on CPU under the interpreter, in a subprocess (this process may have imported Triton without
    it)."""
    import torch

    if torch.cuda.is_available():
        with LaunchRecorder() as rec:
            library_workload("cuda", **workload)
        return rec.variants
    env = {**os.environ, "TRITON_INTERPRET": "1", "CACHEDEMB_BACKEND": "triton", "CACHEDEMB_GPU_SHAPES": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "variants.json"
        cmd = [sys.executable, "-m", "cachedemb.tools.aot", "record", str(out), json.dumps(workload)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"recording worker exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
        return [KernelVariant.from_json(d) for d in json.loads(out.read_text())]


def _record_file(out_path: str, workload_json: str) -> None:
    with LaunchRecorder() as rec:
        library_workload("cpu", **json.loads(workload_json))
    Path(out_path).write_text(json.dumps([v.to_json() for v in rec.variants]))


if __name__ == "__main__":
    {"compile": _compile_file, "record": _record_file}[sys.argv[1]](*sys.argv[2:])
