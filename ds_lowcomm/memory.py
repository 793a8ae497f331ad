"""Step scratch memory and the CPU heap: how large a step's transients may be, where they come
from, and handing freed heap pages back.

A step's transient work (chunk buffers of the collectives, the norm's chunks, AdamW's fp32
chunks, DeMo's tiles) is done ``CHUNK_BYTES`` at a time, in buffers from :func:`temporary`.
The sharded step's own loops (the global norm, AdamW and acco's estimate) take their chunk from
:func:`step_chunk_bytes`: small on the CPU, for the heap, and large on a GPU, where each chunk
costs kernel launches from Python and the caching allocator has no heap to protect.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

#: bytes of each chunk of the chunked gloo collectives, the norm and the step of 2-byte gradients:
#: what their transients hold at once
CHUNK_BYTES = 8 << 20
#: bytes of each chunk of the sharded step's loops on a GPU (the norm, AdamW, acco's estimate): a
#: handful of launches per step for a shard of a few GB, a few chunk-sized fp32 transients
DEVICE_CHUNK_BYTES = 64 << 20
#: glibc's largest dynamic mmap threshold (64-bit): a block at least this large is always
#: mmap-served and unmapped when freed, whatever the threshold has become
MMAP_THRESHOLD_MAX = 32 << 20


def step_chunk_bytes(device: torch.device) -> int:
    """Bytes of each chunk of the sharded step's loops on ``device``: ``CHUNK_BYTES`` on the CPU
    (each chunk's transients come from the heap), ``DEVICE_CHUNK_BYTES`` elsewhere (a loop of
    8 MiB chunks on a GPU was about 2,000 kernel launches per acco step at 86M parameters)."""
    return CHUNK_BYTES if torch.device(device).type == "cpu" else DEVICE_CHUNK_BYTES


def temporary(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D scratch tensor of ``numel`` elements for a step's transient work.

    On CPU it is cut from an allocation of at least ``MMAP_THRESHOLD_MAX``: glibc raises its
    dynamic mmap threshold to the size of any mmap-served block freed below that, after which
    every allocation under that size (the next forward's activations) comes from the heap and
    stays resident when freed (RSS grew step by step on the checkpoint bench's model).
    A larger block never moves the threshold, and the pages a short temporary leaves untouched
    are never resident. Elsewhere (CUDA's caching allocator) a plain ``torch.empty``.
    """
    if torch.device(device).type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    elem = torch.empty((), dtype=dtype).element_size()
    return torch.empty(max(numel, -(-MMAP_THRESHOLD_MAX // elem)), dtype=dtype, device=device)[:numel]


def _glibc_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to release
        return None


_MALLOC_TRIM = None if sys.platform != "linux" else _glibc_malloc_trim()


def release_freed_heap() -> None:
    """Hand heap pages freed since the last call back to the OS (glibc ``malloc_trim``).

    On the CPU accelerator every tensor lives in the process heap. glibc keeps the pages of freed
    blocks below its mmap threshold (32 MiB at most), so the per-parameter gradients autograd
    frees after each backward (fp32 sums of a bf16/fp16 model: see ``GradAccumulator``) stay
    resident and add to the peak RSS though no tensor uses them. It is not free: the next
    backward faults every released page back in (docs/benchmarks.md, the fast regime). Other
    accelerators keep tensors in device memory: call it on CPU only.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
