"""torch's Adam and AdamW step over fp32 or bf16 params and state as one native loop on the
CPU: [Note: native CPU Adam].

The reasoning is [Note: native CPU Adam] below."""

# [Note: native CPU Adam]
#
# On an accelerator the fused Adam step ([Note: fused Adam step] in ``fused_adam.py``) is one
# compiled kernel a chunk. On the CPU (where ``Offload()`` steps the optimizer, and where a
# CPU-only run steps it) neither torch path is fast enough: the eager op sequence is 80-90x
# torch's fused fp32 AdamW with bf16 state, and inductor's kernel 5-6x, because inductor's CPU
# code turns each fp32<->int32 bit cast of the stochastic rounding into a scalar loop and
# loads half-width bf16 vectors through a buffer. So this module compiles one short C loop
# per dtype combination with the system's C compiler, once per machine, and calls it through
# ``ctypes`` (which lets go of the GIL, so a run is split over threads).
#
# What it must keep (tested against the eager function, to the bit):
#
# * **The arithmetic of torch's step, op for op.** The same fp32 operations in the same order
#   as ``fused_adam.adam_chunk``, fused exactly where torch's vector kernels fuse a multiply and
#   an add (``lerp``, ``addcmul``, ``add`` with ``alpha``), and nowhere else: the C is built
#   with ``-ffp-contract=off`` and spells each fused multiply-add as ``fmaf``.
# * **The rounding bits** of [Note: rounding bits], computed from the element's place in its
#   run, so a run cut into pieces (one a thread) draws what it draws whole.
# * **torch's bf16 conversion of a rounded value**: its top 16 bits, and a NaN as a NaN (c10's
#   0x7FC0; torch's vectorized CPU conversion writes 0xFFFF, NaN too: only NaNs' bits differ).
#
# Where it cannot run (no C compiler, a build that fails, ``FLATSHARD_NATIVE_CPU=0``, a dtype
# it does not handle) ``step`` returns False and the caller takes the torch path, which gives
# the same values; the first such fallback warns, naming why. Builds are cached under
# ``$FLATSHARD_CACHE_DIR`` (default ``~/.cache/flatshard``), keyed by the source, the compiler
# and its flags; a build writes a new file and renames it into place, so ranks that build at
# once do not see each other's half-written files.

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["available", "cache_dir", "step"]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline uint32_t fmix(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; return h ^ (h >> 16);
}

/* [Note: rounding bits]: the 32-bit hash of element top * 2**32 + i of its run (far: top > 0),
   two draws of 16 bits */
static inline uint32_t hash(uint32_t i, int far, uint32_t top, uint32_t lo, uint32_t hi) {
    uint32_t h = fmix(i ^ lo);
    if (far) h = fmix(h ^ top);
    return h ^ hi;
}

static inline float f32_load(const void *p, int64_t j) { return ((const float *)p)[j]; }
static inline float bf16_load(const void *p, int64_t j) {
    uint32_t u = (uint32_t)((const uint16_t *)p)[j] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* the hash a store of this dtype rounds with (none for fp32) */
static inline uint32_t f32_hash(uint32_t i, int far, uint32_t top, uint32_t lo, uint32_t hi) {
    (void)i; (void)far; (void)top; (void)lo; (void)hi;
    return 0;
}
static inline uint32_t bf16_hash(uint32_t i, int far, uint32_t top, uint32_t lo, uint32_t hi) {
    return hash(i, far, top, lo, hi);
}
static inline void f32_store(void *p, int64_t j, float value, uint32_t bits) {
    (void)bits;
    ((float *)p)[j] = value;
}
/* stochastic rounding: add the 16 bits below the bf16 ulp, keep the top 16; a NaN as c10
   writes one (0x7FC0), whatever its bits (added to, they could carry into the exponent and
   sign, or leave an infinity's). Testing the value, not the rounded bits, is one compare of
   the fp32 lanes: ~8% of the loop's time less than masking and comparing the rounded bits */
static inline void bf16_store(void *p, int64_t j, float value, uint32_t bits) {
    uint32_t raw;
    memcpy(&raw, &value, 4);
    const uint32_t q = value != value ? 0x7FC00000u : raw + (bits & 0xFFFFu);
    ((uint16_t *)p)[j] = (uint16_t)(q >> 16);
}

/* one loop a dtype combination, compiled twice: for runs' first 2**32 elements (far = 0,
   the one hash round) and for the rest */
#define ADAM(NAME, P, G, S)                                                                   \
static inline __attribute__((always_inline)) void NAME##_loop(                                \
        void *param, const void *grad, void *exp_avg, void *exp_avg_sq, int64_t n,            \
        uint32_t start, int far, uint32_t top, const uint32_t *salts, const float *hyper,     \
        float l2, int maximize) {                                                             \
    const float decay = hyper[0], weight1 = hyper[1], beta2 = hyper[2], weight2 = hyper[3];   \
    const float correction2_sqrt = hyper[4], eps = hyper[5], neg_step_size = hyper[6];        \
    const int small = fabsf(weight1) < 0.5f;                                                  \
    const float coeff = small ? weight1 : weight1 - 1.0f;                                     \
    /* (salts[4:6], exp_avg_sq's, equal exp_avg's: it draws the high half of that hash) */    \
    const uint32_t pl = salts[0], ph = salts[1], ml = salts[2], mh = salts[3];               \
    for (int64_t j = 0; j < n; j++) {                                                         \
        const uint32_t i = start + (uint32_t)j; /* (a call never crosses 2**32) */            \
        float g = G##_load(grad, j);                                                          \
        if (maximize) g = -g;                                                                 \
        const float w0 = P##_load(param, j);                                                  \
        if (l2 != 0.0f) g = fmaf(w0, l2, g);                                                  \
        const float m0 = S##_load(exp_avg, j);                                                \
        const float m = fmaf(coeff, g - m0, small ? m0 : g);                                  \
        const float v = fmaf(weight2 * g, g, S##_load(exp_avg_sq, j) * beta2);                \
        const float w = w0 * decay + (m * neg_step_size) / (sqrtf(v) / correction2_sqrt + eps);\
        const uint32_t moments = S##_hash(i, far, top, ml, mh);                               \
        P##_store(param, j, w, P##_hash(i, far, top, pl, ph));                                \
        S##_store(exp_avg, j, m, moments);                                                    \
        S##_store(exp_avg_sq, j, v, moments >> 16);                                           \
    }                                                                                         \
}                                                                                             \
void NAME(void *param, const void *grad, void *exp_avg, void *exp_avg_sq, int64_t n,         \
          uint32_t start, uint32_t top, const uint32_t *salts, const float *hyper, float l2,  \
          int maximize) {                                                                     \
    if (top == 0)                                                                             \
        NAME##_loop(param, grad, exp_avg, exp_avg_sq, n, start, 0, 0, salts, hyper, l2,       \
                    maximize);                                                                \
    else                                                                                      \
        NAME##_loop(param, grad, exp_avg, exp_avg_sq, n, start, 1, top, salts, hyper, l2,     \
                    maximize);                                                                \
}

ADAM(adam_f32_f32_f32, f32, f32, f32)
ADAM(adam_f32_f32_bf16, f32, f32, bf16)
ADAM(adam_f32_bf16_f32, f32, bf16, f32)
ADAM(adam_f32_bf16_bf16, f32, bf16, bf16)
ADAM(adam_bf16_f32_f32, bf16, f32, f32)
ADAM(adam_bf16_f32_bf16, bf16, f32, bf16)
ADAM(adam_bf16_bf16_f32, bf16, bf16, f32)
ADAM(adam_bf16_bf16_bf16, bf16, bf16, bf16)
"""

_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ARGS = (
    *[ctypes.c_void_p] * 4,  # param, grad, exp_avg, exp_avg_sq
    ctypes.c_int64,  # n
    *[ctypes.c_uint32] * 2,  # start, top: the first element's place in its run
    *[ctypes.c_void_p] * 2,  # salts, hyper
    ctypes.c_float,  # l2
    ctypes.c_int,  # maximize
)
PER_THREAD = 1 << 16
"""Fewest elements a thread steps: below that, handing a piece to a thread costs more than it saves."""
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def available() -> bool:
    """Whether the native loop is built and loaded (building it on first call)."""
    return _library() is not None


def step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    start: int,
    salts: list[int],
    hyper: list[float],
    l2: float,
    maximize: bool,
) -> bool:
    """``fused_adam.adam_chunk`` over contiguous CPU tensors, natively: ``start`` is the first
    element's place in its run, the six ints of ``salts`` the (lo, hi) salt of the param and
    each moment, ``hyper`` ``fused_adam.scalars``. False (nothing done) where the native loop
    cannot take them."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if any(t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in _NAMES for t in tensors):
        return False
    if exp_avg.dtype != exp_avg_sq.dtype or len({t.numel() for t in tensors}) != 1:
        return False
    library = _library()
    if library is None:
        return False
    kernel = getattr(library, f"adam_{_NAMES[param.dtype]}_{_NAMES[grad.dtype]}_{_NAMES[exp_avg.dtype]}")
    salts_c = (ctypes.c_uint32 * 6)(*salts)
    hyper_c = (ctypes.c_float * 7)(*hyper)

    def run(lo: int, hi: int) -> None:
        ptrs = [t.data_ptr() + lo * t.element_size() for t in tensors]
        index = start + lo
        kernel(*ptrs, hi - lo, index & 0xFFFFFFFF, index >> 32, salts_c, hyper_c, l2, int(maximize))

    pieces = _pieces(param.numel(), start)
    if len(pieces) == 1:
        run(*pieces[0])
    else:
        list(_threads().map(lambda piece: run(*piece), pieces))
    return True


def _threads() -> ThreadPoolExecutor:
    """A pool of torch's thread count kept for the process (a step calls once per run, and a
    model has a run per bucket): made again when that count changes, and in a forked child,
    whose copy of the pool has no threads."""
    key = (os.getpid(), torch.get_num_threads())
    if key not in _POOLS:
        _POOLS.clear()
        _POOLS[key] = ThreadPoolExecutor(key[1], thread_name_prefix="flatshard-cpu-adam")
    return _POOLS[key]


def _pieces(n: int, start: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into one piece a thread (none under ``PER_THREAD`` elements), and
    wherever the run's element index crosses a multiple of 2**32 (the C loop counts the
    index in 32 bits)."""
    count = max(1, min(torch.get_num_threads(), n // PER_THREAD))
    cuts = {n * k // count for k in range(count + 1)}
    cuts |= {b - start for b in range((start >> 32) + 1 << 32, start + n, 1 << 32)}
    return list(itertools.pairwise(sorted(cuts)))


def cache_dir() -> Path:
    """Where built loops are kept: ``$FLATSHARD_CACHE_DIR``, else ``~/.cache/flatshard``."""
    configured = os.environ.get("FLATSHARD_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "flatshard"


def _flags() -> list[str]:
    """-O3 with the vector ISA torch itself dispatches to on this CPU (torch checked the CPU
    has it: AVX512 at 16 lanes, else AVX2 at 8); never fused multiply-adds the source does not
    spell, never errno from sqrt (it blocks vectorizing). The lanes change no result: every
    operation is elementwise and correctly rounded at any width."""
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine() not in ("x86_64", "AMD64") or capability == "DEFAULT":
        return flags
    flags += ["-mavx2", "-mfma"]
    if capability == "AVX512":  # (gcc keeps to 256-bit vectors unless told)
        flags += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mprefer-vector-width=512"]
    return flags


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("FLATSHARD_NATIVE_CPU", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _fall_back("no C compiler on PATH (set CC to one)")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256("\n".join([_SOURCE, compiler, version, *_flags()]).encode()).hexdigest()[:20]
        path = cache_dir() / f"cpu_adam-{key}.so"
        if not path.exists():
            _build(compiler, path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        _fall_back(f"{type(e).__name__}: {e}; FLATSHARD_CACHE_DIR sets where it is built")
        return None
    for names in itertools.product(_NAMES.values(), repeat=3):  # (param, grad, state)
        getattr(library, "adam_" + "_".join(names)).argtypes = _ARGS
    return library


def _build(compiler: str, path: Path) -> None:
    """Compile the loops into ``path``: in a folder of its own, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as folder:
        source = Path(folder) / "cpu_adam.c"
        source.write_text(_SOURCE)
        built = Path(folder) / path.name
        done = subprocess.run(
            [compiler, *_flags(), str(source), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} exited with {done.returncode}: {done.stderr[-2000:]}")
        os.replace(built, path)


def _fall_back(reason: str) -> None:
    warnings.warn(
        f"flatshard's native CPU Adam step is not available ({reason}); the host step of "
        "Adam with bf16 params or state runs as torch ops, tens of times slower",
        stacklevel=3,
    )
