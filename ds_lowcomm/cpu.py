"""CPU-only conveniences."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys


def skip_shm_comm_build() -> None:
    """Stop DeepSpeed (0.19.8) from JIT-compiling its shared-memory comm op on the CPU accelerator.

    ``TorchBackend.__init__`` builds ``deepspeed_shm_comm`` (~30 s cold) for ``inference_all_reduce``
    only (``deepspeed/comm/torch.py``); training collectives never use it. Call before
    ``deepspeed.init_distributed`` / ``deepspeed.initialize``. No effect on other accelerators.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.comm.torch  # noqa: F401

    # ``import deepspeed.comm.torch as m`` would bind the real torch: deepspeed.comm has a ``torch``
    # attribute. Go through sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


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
    resident and add up to tens of MB of peak RSS that no tensor uses. It is not free: the next
    backward faults every released page back in (see the README's fast regime). Other
    accelerators keep tensors in device memory: call it on CPU only.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
