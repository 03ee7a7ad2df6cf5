"""The CPU paged decode kernel (cpu_attention.c): built once per machine with the C compiler, loaded
with ctypes, called on tensors' data pointers. No torch headers and no Python build step: a plain C
file compiles in under a second with `cc -O3 -march=native -fopenmp`. The shared object is cached
under ~/.cache/lmi-serve/kernels (a temporary directory when home is not writable), named by a hash
of the source, the flags, the compiler's version and this CPU's feature flags, so a changed file, a
new compiler or another machine (an image moved between hosts) builds afresh; it is written under a
temporary name and renamed, so that processes building at once (tensor-parallel ranks) never load a
half-written file.

    kernel = load()                      # None when it cannot build here: why() says why
    out = paged_decode(q, k_cache, v_cache, block_table, context_lens, opts)

Its PyTorch twin, the oracle in tests, is engines.attention.torch_backend.decode_attention.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engines.devices import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
HEADER = SOURCE.with_name("cpu_kernels.h")  # shared by the CPU kernels
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
DTYPES = {torch.float32: "lmi_paged_decode_f32", torch.bfloat16: "lmi_paged_decode_bf16"}
_failure: list[str] = []  # why the kernel did not build, once load() has failed


def why() -> str:
    """Why load() returned None ('' when it did not)."""
    return _failure[0] if _failure else ""


def _cache_dirs() -> list[Path]:
    return [Path.home() / ".cache" / "lmi-serve" / "kernels",
            Path(tempfile.gettempdir()) / f"lmi-serve-kernels-{os.getuid()}"]


def build(compiler: str, target: Path, extra_flags: tuple[str, ...] = (), source: Path = SOURCE) -> None:
    """Compile a kernel source to `target`, atomically (a temporary name, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *extra_flags, "-o", partial, str(source), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def bind(path: Path) -> ctypes.CDLL:
    """The built kernel, its functions typed."""
    lib = ctypes.CDLL(str(path))
    for name in DTYPES.values():
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _fail(reason: str) -> None:
    _failure.append(reason)
    log.warning("the CPU paged decode kernel did not build (%s): auto picks the torch attention backend", reason)


class BuildError(Exception):
    """Why a kernel cannot be built here, in one sentence."""


def cached_build(source: Path, what: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared object of `source` for this compiler and CPU (and `extra_flags` after FLAGS): built here
    unless cached (`what` names it in the log). BuildError when it cannot be."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    texts = [source.read_text(), HEADER.read_text()]  # the kernel and what it includes
    flags = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS + extra_flags), version, flags]).encode()).hexdigest()
    errors = []
    for directory in _cache_dirs():
        target = directory / f"{source.stem}-{key[:16]}.so"
        try:
            if not target.exists():
                build(cc, target, extra_flags, source=source)
                log.info("built the %s: %s", what, target)
            return target
        except subprocess.CalledProcessError as e:  # the source or the flags: no other directory helps
            raise BuildError(f"{cc} failed: {e.stderr.strip()[-500:]}") from None
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{directory}: {e}")
    raise BuildError("; ".join(errors))


def load_or_warn(source: Path, what: str, bind_fn, instead: str, extra_flags: tuple[str, ...] = ()):
    """bind_fn(the built `source`), or None — logged once, naming `what` and what runs `instead` — when
    it cannot be built here (the CPU kernels' `load`)."""
    try:
        return bind_fn(cached_build(source, what, extra_flags))
    except (BuildError, OSError) as e:
        log.warning("the %s did not build (%s): %s", what, e, instead)
        return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel, built here if no build of this source, compiler and CPU is cached; None (logged once,
    why() says why) when it cannot build."""
    try:
        return bind(cached_build(SOURCE, "CPU paged decode kernel"))
    except (BuildError, OSError) as e:
        _fail(str(e))
        return None


def named_call(name: str, call):
    """call() — a foreign (ctypes) call — named `name` for torch.profiler while it records; unnamed
    otherwise (the record costs as much as a small kernel)."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(name):
            return call()
    return call()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, opts, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (last dim contiguous), caches [Hkv, num_blocks, block_size, D] contiguous, in q's
    dtype (float32 or bf16); block_table [B, >= blocks of the longest row] and context_lens [B], int64
    (converted when not) → [B, Hq, D]. opts: the layer's LayerOptions; lib: another build (tests)."""
    fn = getattr(lib or load(), DTYPES[q.dtype])
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_table, context_lens = block_table.long(), context_lens.long().contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    b, hq, d = q.shape
    hkv, num_blocks, block_size, _ = k_cache.shape
    out = torch.empty((b, hq, d), dtype=q.dtype)
    failed = named_call("lmi::cpu_paged_decode", lambda: fn(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
        block_table.stride(0), context_lens.data_ptr(), out.data_ptr(), b, hq, hkv, d, num_blocks, block_size,
        opts.scale, opts.window or 0, opts.softcap or 0.0, torch.get_num_threads()))
    if failed:
        raise MemoryError("the CPU paged decode kernel could not allocate its scratch memory")
    return out
