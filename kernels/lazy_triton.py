"""Triton imported when a Triton kernel first runs, not when `cachedemb` is imported.

On CPU every op runs its torch reference, and importing Triton is a large share of `import cachedemb`'s time.
The kernel files take `triton` and `tl` from here: `@triton.jit` then records the function, and a `tl.*` name in
its signature (`tl.constexpr`, `tl.int64`), read while the module body runs, is a placeholder. The first launch (or any other use of `triton.*` / `tl.*`) imports Triton and
`load()` puts the real modules and `triton.jit` functions in place of the stand-ins in every kernel module, so a
kernel's body, compiled later, sees only Triton's own objects.
"""
from __future__ import annotations

import sys
import threading

_lock = threading.RLock()
_modules: list[dict] = []  # globals of the kernel modules holding stand-ins
_real: dict[str, object] = {}  # "triton", "tl" once imported


class _Annotation:
    """`tl.<name>` read by a kernel module's body before Triton is imported: an annotation of a `@triton.jit`
    signature, replaced by the real object when the kernel is made."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"tl.{self.name} (Triton not imported yet)"


def load():
    """Import Triton and replace every stand-in by the real object; returns the triton module."""
    with _lock:
        if "triton" not in _real:
            import triton
            import triton.language as tl

            _real.update(triton=triton, tl=tl)
            for names in _modules:
                for key, value in list(names.items()):
                    if value is _TRITON:
                        names[key] = triton
                    elif value is _TL:
                        names[key] = tl
                    elif isinstance(value, LazyKernel):
                        names[key] = value.real()
        return _real["triton"]


class LazyKernel:
    """A `@triton.jit` function whose JITFunction is made at its first use."""

    def __init__(self, fn, options: dict):
        self.fn, self.options, self._jit = fn, options, None
        self.__name__, self.__doc__, self.__module__ = fn.__name__, fn.__doc__, fn.__module__
        with _lock:
            if all(names is not fn.__globals__ for names in _modules):
                _modules.append(fn.__globals__)

    def real(self):
        with _lock:
            if self._jit is None:
                triton = load()
                tl = _real["tl"]
                self.fn.__annotations__ = {k: getattr(tl, v.name) if isinstance(v, _Annotation) else v
                                           for k, v in self.fn.__annotations__.items()}
                self._jit = triton.jit(self.fn, **self.options)
            return self._jit

    def __getitem__(self, grid):
        return self.real()[grid]

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.real(), name)


class _TritonStandIn:
    """`triton` before it is imported: `jit` records kernels, the integer helpers the torch paths size buffers
    with are Triton's own arithmetic; anything else imports Triton."""

    def jit(self, fn=None, **options):
        if fn is None:
            return lambda f: LazyKernel(f, options)
        return LazyKernel(fn, options)

    @staticmethod
    def next_power_of_2(n: int) -> int:
        """triton.next_power_of_2, bit for bit."""
        n -= 1
        for shift in (1, 2, 4, 8, 16, 32):
            n |= n >> shift
        return n + 1

    @staticmethod
    def cdiv(x: int, y: int) -> int:
        """triton.cdiv."""
        return (x + y - 1) // y

    def __getattr__(self, name):
        return getattr(load(), name)


class _LanguageStandIn:
    """`triton.language` before it is imported: names read by a module body (signature annotations) are
    placeholders; read anywhere else (a launcher's code), they import Triton."""

    def __getattr__(self, name):
        if "tl" not in _real and sys._getframe(1).f_code.co_name == "<module>":
            return _Annotation(name)
        load()
        return getattr(_real["tl"], name)


_TRITON, _TL = _TritonStandIn(), _LanguageStandIn()


def stand_ins():
    """(triton, tl) for a kernel module: the real modules once Triton is imported, else the stand-ins."""
    if "triton" in _real:
        return _real["triton"], _real["tl"]
    return _TRITON, _TL


def __getattr__(name: str):
    """`from .lazy_triton import tl, triton` in a kernel file."""
    if name == "triton":
        return stand_ins()[0]
    if name == "tl":
        return stand_ins()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
