"""Fast CPU relocation: `rotate_reference`'s result in one read and one write of the keys.

The plain reference (`kamera_core.relocate.rotate_reference`) walks the keys several times: cast
to float32, slice, multiply, concatenate, cast back. Here a small C kernel (below, built once per
machine with the system C compiler and loaded with ctypes) makes one pass: for each row it loads a
block of first members x1 and their partners x2 in the keys' dtype, forms

    o1 = x1·cos − x2·sin,   o2 = x2·cos + x1·sin   (+ the patch u·vt, when given)

in the compute dtype with the same operations in the same order as the reference (built with
`-ffp-contract=off`, so no fused multiply-add changes a rounding), and stores the results rounded
once to the keys' dtype (round to nearest even, as torch does). Results are therefore equal to the
reference bit for bit. Dims past `rotary_dim` (partial rotary) are copied (plus the patch).

Each block's loads finish before its stores, so the output may be the keys themselves (in place,
`rotate_cpu_inplace`). Out of place and large, rows are written with non-temporal stores where the
CPU has them, so writing the result does not first read its old cache lines (as memcpy does) —
unless the output's pages are not yet mapped in (fresh memory from the OS): the kernel zero-fills
those on first touch, leaving dirty lines in cache that plain stores overwrite for free and
non-temporal stores would have to write back first. `_pages_resident` tells the two apart.

Supported (keys dtype, compute dtype): (bfloat16, float32), (float16, float32), (float32, float32),
(float64, float64). Anything else, or a machine where the kernel cannot be built (no C compiler,
or `KAMERA_CPU_KERNEL=0`), uses `rotate_reference`; a build failure warns once. The build is
cached in `$KAMERA_CACHE_DIR` (default `~/.cache/kamera`, or the temp dir) under a hash of the
source, the flags and the CPU, so later processes load it directly. `kernel_status()` says which
path is in use.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Generic, TypeVar

import torch

from kamera_core.relocate.reference import rotate_reference

# Out-of-place results at least this large are written with non-temporal stores.
STREAM_MIN_BYTES = 1 << 20

_C_SOURCE = (Path(__file__).parent / "cpu_rotate.c").read_text(encoding="utf-8")

# Flag sets tried in order; the first that builds is used.
_BASE_FLAGS = ("-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
_FLAG_SETS = (
    ("-march=native", "-fopenmp"),
    ("-fopenmp",),
    ("-march=native",),
    (),
)
# (keys dtype, compute dtype) -> exported symbol
_SYMBOLS = {
    (torch.bfloat16, torch.float32): "kamera_rotate_bf16",
    (torch.float16, torch.float32): "kamera_rotate_f16",
    (torch.float32, torch.float32): "kamera_rotate_f32",
    (torch.float64, torch.float64): "kamera_rotate_f64",
}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # x, out, delta
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # rows, head_dim, half
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,  # interleaved, cos, sin
    ctypes.c_int, ctypes.c_int,  # nthreads, stream
]


class _Kernel:
    """The built C kernel: one ctypes function per supported (keys dtype, compute dtype)."""

    def __init__(self, path: Path, flags: tuple[str, ...], cached: bool) -> None:
        self.path = path
        self.flags = flags
        self.cached = cached
        self.build_s = 0.0  # seconds to build (or, when cached, to load); set by _load_kernel
        lib = ctypes.CDLL(str(path))
        self.functions = {}
        for dtypes, symbol in _SYMBOLS.items():
            if symbol == "kamera_rotate_f16" and not lib.kamera_has_f16():
                continue
            fn = getattr(lib, symbol)
            fn.argtypes = _ARGTYPES
            fn.restype = None
            self.functions[dtypes] = fn
        self._lib = lib  # keeps the library loaded


_K = TypeVar("_K")



def _disabled_reason() -> str | None:
    """Why the C kernel is off for this process, or None."""
    if os.environ.get("KAMERA_CPU_KERNEL", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by KAMERA_CPU_KERNEL"
    return None


def _usable_dir(path: Path) -> bool:
    """Create `path` (private) if needed; whether it is ours and writable."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    if hasattr(os, "getuid") and path.stat().st_uid != os.getuid():
        return False  # never load code from a directory another user controls
    return os.access(path, os.W_OK)


def _cache_dir() -> Path:
    """Where built kernels live: $KAMERA_CACHE_DIR, else ~/.cache/kamera, else <tmp>/kamera-<uid>."""
    explicit = os.environ.get("KAMERA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kamera"
    if _usable_dir(home_cache):
        return home_cache
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"kamera-{uid}"


def _cpu_fingerprint() -> str:
    """Text that changes when the CPU (and so what -march=native emits) changes."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            lines = [ln for ln in fh if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(compiler: str, flags: tuple[str, ...], target: Path, source: str = _C_SOURCE,
           name: str = "cpu_rotate") -> str | None:
    """Compile `source` (default: this module's kernel) into `target` (atomically); returns the
    compiler's error text or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source, encoding="utf-8")
        obj = Path(tmp) / target.name
        cmd = [compiler, *_BASE_FLAGS, *flags, str(src), "-o", str(obj)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip()[-2000:]
        os.replace(obj, target)
    return None


def _load_kernel() -> tuple[_Kernel | None, str | None]:
    """Build (or find in the cache) and load the kernel; (kernel, None) or (None, reason)."""
    return _load_library(_C_SOURCE, "cpu_rotate", _Kernel)


def _load_library(source: str, name: str, make: Callable[[Path, tuple[str, ...], bool], _K]) -> tuple[_K | None, str | None]:
    """Build C `source` with the first flag set that compiles (or find it in the cache, as
    `<name>_<hash>.so`) and load it with `make(path, flags, cached)` (an OSError from it counts as
    a failed build: the next flag set is tried); sets the result's `build_s`. Returns
    (loaded, None) or (None, reason)."""
    disabled = _disabled_reason()
    if disabled:
        return None, disabled
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found (set CC, or install gcc/clang)"
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256("\0".join((source, compiler, *_BASE_FLAGS, *flags, _cpu_fingerprint())).encode())
        target = _cache_dir() / f"{name}_{key.hexdigest()[:20]}.so"
        start = time.perf_counter()
        cached = target.exists()
        try:
            error = None if cached else _build(compiler, flags, target, source, name)
            if error is None:
                kernel = make(target, flags, cached)
                kernel.build_s = time.perf_counter() - start  # type: ignore[attr-defined]
                return kernel, None
        except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, compiler crash, bad .so
            error = f"{type(exc).__name__}: {exc}"
        errors.append(f"[{' '.join(flags) or 'no extra flags'}] {error.splitlines()[-1] if error else ''}")
    return None, "could not build the C kernel: " + " | ".join(errors)


class LazyKernel(Generic[_K]):
    """A C kernel built (or found in the cache) and loaded on first use, once per process and
    thread-safe. `get()` is the kernel, or None after one RuntimeWarning saying that `fallback`
    is used instead (no warning when the kernel was disabled on purpose)."""

    def __init__(self, load: Callable[[], tuple[_K | None, str | None]], what: str, fallback: str) -> None:
        self._load, self._what, self._fallback = load, what, fallback
        self._lock = threading.Lock()
        self.kernel: _K | None = None
        self.tried = False
        self.reason: str | None = None

    def fresh(self) -> "LazyKernel[_K]":
        """The same loader, not tried yet."""
        return LazyKernel(self._load, self._what, self._fallback)

    def get(self) -> _K | None:
        if self.tried:
            return self.kernel
        with self._lock:
            if not self.tried:
                self.kernel, self.reason = self._load()
                self.tried = True
                if self.kernel is None and self.reason != _disabled_reason():
                    warnings.warn(f"kamera_core.{self._what}: {self.reason}; {self._fallback}", RuntimeWarning,
                                  stacklevel=4)
        return self.kernel

    def status(self, extra: Callable[[_K | None], dict[str, object]]) -> dict[str, object]:
        """available, path, flags, build_s, cached (see `kernel_status`), then `extra(kernel)`, then
        reason; builds the kernel if not tried yet."""
        kernel = self.get()
        out: dict[str, object] = {
            "available": kernel is not None,
            "path": str(kernel.path) if kernel else None,  # type: ignore[attr-defined]
            "flags": list(_BASE_FLAGS + kernel.flags) if kernel else None,  # type: ignore[attr-defined]
            "build_s": kernel.build_s if kernel else None,  # type: ignore[attr-defined]
            "cached": kernel.cached if kernel else None,  # type: ignore[attr-defined]
        }
        return {**out, **extra(kernel), "reason": self.reason}


_KERNEL: LazyKernel[_Kernel] = LazyKernel(_load_kernel, "cpu_relocate",
                                          "relocation on CPU uses the slower rotate_reference")


def _kernel() -> _Kernel | None:
    """The loaded kernel, building it on first use; None (after one warning) when unavailable."""
    return _KERNEL.get()


def kernel_status() -> dict[str, object]:
    """Which CPU path relocation uses: builds the kernel if not tried yet.

    Keys: available (bool), path (the .so or None), flags, build_s (seconds to build, or to load
    when cached), cached (the build came from an earlier process), dtypes (supported keys/compute
    dtype pairs), reason (why not available, else None).
    """
    return _KERNEL.status(lambda k: {"dtypes": [f"{a}/{c}".replace("torch.", "") for a, c in k.functions] if k else []})


def _check_args(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str,
    u: torch.Tensor | None, vt: torch.Tensor | None,
) -> None:
    if pairing not in ("half", "interleaved"):
        raise ValueError(f"pairing must be 'half' or 'interleaved', got {pairing!r}")
    if keys.device.type != "cpu":
        raise ValueError(f"the CPU relocation needs CPU tensors, got keys on {keys.device}")
    if keys.dim() < 1 or not keys.is_floating_point():
        raise ValueError(f"keys must be a float tensor [tokens, ..., head_dim], got {keys.dtype} {tuple(keys.shape)}")
    if cos.dim() != 1 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must both be [rotary_dim // 2], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if 2 * cos.shape[0] > keys.shape[-1]:
        raise ValueError(f"rotary_dim {2 * cos.shape[0]} exceeds head_dim {keys.shape[-1]}")
    if (u is None) != (vt is None):
        raise ValueError("a patch needs both u and vt")
    if u is not None:  # the kernel reads u·vt with keys' layout: shapes must agree exactly
        if u.dim() != 2 or u.shape[0] != keys.shape[0]:
            raise ValueError(f"patch u must be [tokens={keys.shape[0]}, rank], got {tuple(u.shape)}")
        if tuple(vt.shape) != (u.shape[1], *keys.shape[1:]):
            raise ValueError(f"patch vt must be [rank={u.shape[1]}, *{tuple(keys.shape[1:])}], got {tuple(vt.shape)}")


def _byte_ranges_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def _patch_delta(u: torch.Tensor, vt: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """`u·vt` in the compute dtype, `[tokens, rest * head_dim]` contiguous (the reference's product).

    u: `[tokens, rank]`; vt: `[rank, *rest, head_dim]`.
    """
    rank = u.shape[1]
    return (u.to(compute) @ vt.to(compute).reshape(rank, -1)).contiguous()


_MINCORE: list[object] = []  # [libc.mincore or None], looked up once


def _mincore() -> object | None:
    """libc's mincore(2) via ctypes, or None where there is none (non-Linux)."""
    if not _MINCORE:
        fn = None
        if hasattr(os, "sysconf") and platform.system() == "Linux":
            try:
                fn = ctypes.CDLL(None, use_errno=True).mincore
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _MINCORE.append(fn)
    return _MINCORE[0]


def _pages_resident(t: torch.Tensor) -> bool:
    """Whether the first, middle and last pages of contiguous `t` are mapped in (True when unknown).

    Freshly allocated large buffers are often not: their first write faults and zero-fills them.
    """
    mincore = _mincore()
    if mincore is None:
        return True
    page = os.sysconf("SC_PAGE_SIZE")
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    flag = (ctypes.c_ubyte * 1)()
    for addr in (start, start + nbytes // 2, start + nbytes - 1):
        if mincore(addr - addr % page, page, flag) != 0:  # type: ignore[operator]
            return True
        if not flag[0] & 1:
            return False
    return True


def _run_kernel(
    fn: object, keys: torch.Tensor, out: torch.Tensor, delta: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, pairing: str,
) -> None:
    """Call the C kernel. keys, out: contiguous `[tokens, *rest, head_dim]` (out may be keys);
    delta: contiguous compute-dtype tensor with keys' numel, or None; cos, sin: contiguous `[half]`."""
    head_dim = keys.shape[-1]
    inplace = out.data_ptr() == keys.data_ptr()
    stream = not inplace and out.numel() * out.element_size() >= STREAM_MIN_BYTES and _pages_resident(out)
    fn(  # type: ignore[operator]
        keys.data_ptr(), out.data_ptr(), None if delta is None else delta.data_ptr(),
        keys.numel() // head_dim, head_dim, cos.shape[0], int(pairing == "interleaved"),
        cos.data_ptr(), sin.data_ptr(), torch.get_num_threads(), int(stream),
    )


def rotate_cpu_into(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pairing: str,
    out: torch.Tensor,
    u: torch.Tensor | None = None,
    vt: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out = R·keys (+ u·vt)`; `out` may be `keys` itself (in place). Returns `out`.

    keys, out: `[tokens, *rest, head_dim]`, same shape and dtype, contiguous, CPU; cos, sin:
    `[rotary_dim // 2]` compute dtype (float32, or float64 for float64 keys); u: `[tokens, rank]`,
    vt: `[rank, *rest, head_dim]`. Values equal `rotate_reference(keys, cos, sin, pairing, u, vt)`.
    `out` must be `keys` or not overlap it.
    """
    _check_args(keys, cos, sin, pairing, u, vt)
    if out.shape != keys.shape or out.dtype != keys.dtype or out.device != keys.device:
        raise ValueError(f"out must match keys {tuple(keys.shape)} {keys.dtype}, got {tuple(out.shape)} {out.dtype}")
    if not (keys.is_contiguous() and out.is_contiguous()):
        raise ValueError("rotate_cpu_into needs contiguous keys and out")
    inplace = out.data_ptr() == keys.data_ptr()
    if not inplace and _byte_ranges_overlap(keys, out):  # a partial overlap would race
        raise ValueError("out overlaps keys without being keys itself")
    if keys.numel() == 0:
        return out
    kernel = _kernel()
    fn = kernel.functions.get((keys.dtype, cos.dtype)) if kernel is not None else None
    if fn is None or sin.dtype != cos.dtype:
        return out.copy_(rotate_reference(keys, cos, sin, pairing, u, vt))
    delta = None if u is None else _patch_delta(u, vt, cos.dtype)  # [tokens, rest * head_dim]
    cos, sin = cos.to(keys.device).contiguous(), sin.to(keys.device).contiguous()
    _run_kernel(fn, keys, out, delta, cos, sin, pairing)
    return out


def rotate_cpu(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pairing: str,
    u: torch.Tensor | None = None,
    vt: torch.Tensor | None = None,
) -> torch.Tensor:
    """`R·keys (+ u·vt)` as a new tensor: the same contract and values as `rotate_reference`.

    keys: `[tokens, *rest, head_dim]` any float dtype, CPU; cos, sin: `[rotary_dim // 2]` in the
    compute dtype; u: `[tokens, rank]`, vt: `[rank, *rest, head_dim]`. Returns a new contiguous
    tensor of keys' dtype and shape; inputs are not mutated.
    """
    _check_args(keys, cos, sin, pairing, u, vt)
    keys = keys.contiguous()
    out = torch.empty_like(keys)  # [tokens, *rest, head_dim]
    return rotate_cpu_into(keys, cos, sin, pairing, out, u, vt)


def rotate_cpu_inplace(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pairing: str,
    u: torch.Tensor | None = None,
    vt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Overwrite contiguous `keys` with `R·keys (+ u·vt)`, as a cache relocating a chunk in its
    own buffer wants. Returns `keys`. Same values as `rotate_reference`."""
    return rotate_cpu_into(keys, cos, sin, pairing, keys, u, vt)
