"""ds_lowcomm: low-communication data-parallel training modes inside DeepSpeed.

``import ds_lowcomm`` patches ``deepspeed.initialize`` so a DeepSpeed JSON with a ``"lowcomm"``
section builds a :class:`LowCommEngine`; without the section DeepSpeed runs as stock.
"""
from ds_lowcomm.checkpoint import CheckpointError, export_fp32
from ds_lowcomm.comm.collectives import CollectiveError
from ds_lowcomm.config import LowCommConfig, LowCommConfigError
from ds_lowcomm.integration.cpu import skip_shm_comm_build
from ds_lowcomm.integration.engine import LowCommEngine
from ds_lowcomm.integration.initialize import initialize, install
from ds_lowcomm.integration.preemption import PreemptionGuard
from ds_lowcomm.modes import MODES
from ds_lowcomm.optimizer import LowCommOptimizer

__version__ = "0.1.0"
__all__ = ["initialize", "install", "LowCommEngine", "LowCommOptimizer", "LowCommConfig",
           "LowCommConfigError", "CheckpointError", "CollectiveError", "export_fp32", "MODES", "skip_shm_comm_build",
           "PreemptionGuard"]

install()
