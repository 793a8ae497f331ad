"""DeepSpeed on the CPU accelerator: what it would build and never use."""
from __future__ import annotations

import sys


def skip_shm_comm_build() -> None:
    """Stop DeepSpeed (0.19.8) from JIT-compiling its shared-memory comm op on the CPU accelerator.

    ``TorchBackend.__init__`` builds ``deepspeed_shm_comm`` (a JIT compile on a cold cache) for
    ``inference_all_reduce`` only (``deepspeed/comm/torch.py``); training collectives never use it.
    Call before ``deepspeed.init_distributed`` / ``deepspeed.initialize``. No effect on other
    accelerators.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.comm.torch  # noqa: F401

    # ``import deepspeed.comm.torch as m`` would bind the real torch: deepspeed.comm has a ``torch``
    # attribute. Go through sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
