"""``deepspeed.initialize`` with ds_lowcomm: the entry point, explicit or patched in.

``import ds_lowcomm`` replaces ``deepspeed.initialize`` with :func:`initialize`; a config without a
``"lowcomm"`` section goes to DeepSpeed untouched, unless a key looks like a misspelt one (an error). Accelerate and the Hugging Face Trainer look
``deepspeed.initialize`` up at call time (accelerate 1.15 ``_prepare_deepspeed``), so they pick it up.
"""
from __future__ import annotations

import copy
import functools
import inspect
from datetime import timedelta

import deepspeed
import torch

from ds_lowcomm.config import SECTION, LowCommConfigError, check_section_name, parse
from ds_lowcomm.modes import MODES

_original_initialize = deepspeed.initialize


def _resolve_config(bound: inspect.BoundArguments):
    """The config dict DeepSpeed would use: ``config`` / ``config_params`` / ``args.deepspeed_config``."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    a = bound.arguments
    config = a.get("config") if a.get("config") is not None else a.get("config_params")
    args = a.get("args")
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
    return None if config is None else load_ds_config(config)


def _check_model(model) -> None:
    from deepspeed.moe.layer import MoE
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise LowCommConfigError("model: pipeline parallelism (PipelineModule) is not supported by "
                                 "ds_lowcomm; remove the \"lowcomm\" section to use DeepSpeed's pipeline engine")
    if any(isinstance(m, MoE) for m in model.modules()):
        raise LowCommConfigError("model: DeepSpeed MoE layers are not supported by ds_lowcomm")


@functools.wraps(_original_initialize)
def initialize(*args, **kwargs):
    """``deepspeed.initialize`` (same signature and return value), with a :class:`LowCommEngine`
    when the config has a ``"lowcomm"`` section.

    Validates the whole config first (raises :class:`LowCommConfigError`), initialises
    torch.distributed with ``lowcomm.collective_timeout_s`` if nobody has, and builds the engine
    with a copy of the config at ZeRO stage 0.
    """
    bound = inspect.signature(_original_initialize).bind(*args, **kwargs)
    ds_config = _resolve_config(bound)
    if ds_config is not None:
        check_section_name(ds_config)
    if ds_config is None or SECTION not in ds_config:
        return _original_initialize(*args, **kwargs)
    cfg = parse(ds_config, MODES)
    a = bound.arguments
    if a.get("model") is None:
        raise LowCommConfigError("model: deepspeed.initialize needs a model")
    _check_model(a["model"])
    if a.get("optimizer") is None and "optimizer" not in ds_config:
        raise LowCommConfigError("optimizer: missing; add an \"optimizer\": {\"type\": \"AdamW\", "
                                 "\"params\": {...}} section or pass optimizer= to initialize")
    if not torch.distributed.is_initialized():
        from deepspeed.accelerator import get_accelerator

        from ds_lowcomm.integration.cpu import skip_shm_comm_build

        skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   timeout=timedelta(seconds=cfg.collective_timeout_s))

    stage0 = copy.deepcopy(ds_config)
    stage0["zero_optimization"]["stage"] = 0
    if str(stage0.get("optimizer", {}).get("type", "")).lower() == "lowcommadamw":
        # The custom type name makes stock DeepSpeed fail loudly when ds_lowcomm is not loaded.
        stage0["optimizer"]["type"] = "AdamW"
    a["config"] = stage0
    a.pop("config_params", None)
    if a.get("args") is not None and getattr(a["args"], "deepspeed_config", None) is not None:
        a["args"] = copy.copy(a["args"])
        a["args"].deepspeed_config = None

    from ds_lowcomm.integration.engine import LowCommEngine
    from ds_lowcomm.integration.hf import install_trainer_hooks

    install_trainer_hooks()  # a no-op unless the Hugging Face Trainer is loaded
    # DeepSpeed's initialize builds ``DeepSpeedEngine(...)`` by its module-level name.
    saved, deepspeed.DeepSpeedEngine = deepspeed.DeepSpeedEngine, functools.partial(LowCommEngine, lowcomm_config=cfg)
    try:
        return _original_initialize(*bound.args, **bound.kwargs)
    finally:
        deepspeed.DeepSpeedEngine = saved


def install() -> None:
    """Make ``deepspeed.initialize`` this function (idempotent)."""
    deepspeed.initialize = initialize
