"""glibc's malloc, set for a training loop on the CPU.

Every optimizer step frees and allocates again the same large tensors: the weight gradients (4
bytes per parameter and agent), a backward's activations, a rollout's KV cache. glibc serves a
block above its mmap threshold with a fresh ``mmap`` and returns it to the kernel when freed, and
trims the top of its heap once more than the trim threshold is free there; the next step's
allocation of the same size is then faulted in again, page by page, each page zeroed by the
kernel. For a Qwen2.5-0.5B-shaped pair in bf16 that kernel time was 9.9 s of CPU per epoch, in an
update phase of 17-18 s (benchmarks/realsize.py, 2 threads).

:func:`tune_malloc` raises the mmap threshold to glibc's largest (32 MiB on 64-bit: each matrix
of a Qwen2.5-0.5B layer is below it; larger blocks, such as an embedding with a 150k vocabulary,
are still mapped and returned each time) and the trim threshold to 2 GiB, so that freed blocks
stay in the heap and the next step reuses them, as PyTorch's CUDA caching allocator does on the
GPU. The process keeps what it once held, up to 2 GiB free in each arena; measured, the peak RSS
of that bf16 pair's epoch did not grow (11,886 MB against 11,891). The setting is the process's
(malloc has one) and forked children inherit it. ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` / ``GLIBC_TUNABLES`` set by the user are left alone, and
``COMLRL_MALLOC_TUNING=0`` turns this off; other allocators (jemalloc or tcmalloc preloaded) do not
read glibc's settings.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["tune_malloc", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

logger = logging.getLogger("comlrl")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's DEFAULT_MMAP_THRESHOLD_MAX
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_done: str | None = None


def tune_malloc() -> str:
    """Set glibc's malloc for a training loop (see the module docstring), once per process.
    Returns what was done, or why nothing was (the same text on later calls)."""
    global _done
    if _done is None:
        _done = _tune()
        logger.debug("comlrl: malloc %s", _done)
    return _done


def _tune() -> str:
    if os.environ.get("COMLRL_MALLOC_TUNING", "1").strip() == "0":
        return "left alone: COMLRL_MALLOC_TUNING=0"
    given = [name for name in _USER_SETTINGS if name in os.environ]
    if given:
        return f"left alone: {', '.join(given)} set"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "left alone: not glibc"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "left alone: no mallopt"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "left alone: mallopt refused"
    return f"tuned: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
