"""``deepspeed.initialize`` with ds_lowcomm: the entry point, explicit or patched in.

``import ds_lowcomm`` replaces ``deepspeed.initialize`` with :func:`initialize`; a config without a
``"lowcomm"`` section goes to DeepSpeed untouched, unless a key looks like a misspelt one (an error). Accelerate and the Hugging Face Trainer look
``deepspeed.initialize`` up at call time (accelerate 1.15 ``_prepare_deepspeed``), so they pick it up.
"""
from __future__ import annotations

import base64
import copy
import functools
import inspect
import logging
import os
from datetime import timedelta

import deepspeed
import hjson
import torch

from ds_lowcomm import configs
from ds_lowcomm.comm.topology import warn_one_hardware_queue
from ds_lowcomm.config import SECTION, LowCommConfigError, check_section_name, parse
from ds_lowcomm.modes import MODES

_original_initialize = deepspeed.initialize
#: the DeepSpeed releases ds_lowcomm runs on (setup.py's install_requires names the same): it
#: overrides engine internals of this series (``_configure_optimizer``, the boundary and backward
#: hooks), whose private names DeepSpeed may change in any minor release. Tested on 0.19.8.
DEEPSPEED_VERSIONS = ">=0.19.8,<0.20"


def check_deepspeed_version(version: str) -> None:
    """Raise :class:`LowCommConfigError` in one line when DeepSpeed ``version`` is outside
    :data:`DEEPSPEED_VERSIONS`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(version) not in SpecifierSet(DEEPSPEED_VERSIONS):
        raise LowCommConfigError(f"DeepSpeed {version}: ds_lowcomm runs on deepspeed{DEEPSPEED_VERSIONS} (tested "
                                 f"on 0.19.8); install one (pip install 'deepspeed{DEEPSPEED_VERSIONS}'), or "
                                 f"remove the \"{SECTION}\" section to train stock DeepSpeed")


def _is_base64_json(text: str) -> bool:
    try:  # as DeepSpeed (0.19.8) reads a string that is not a file
        hjson.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
        return True
    except (ValueError, TypeError, hjson.HjsonDecodeError):
        return False


def _resolve_config(bound: inspect.BoundArguments):
    """The config dict DeepSpeed would use: ``config`` / ``config_params`` / ``args.deepspeed_config``.

    A string that is neither a file nor base64 JSON (DeepSpeed's two readings of a string) is a
    shipped config's name (:mod:`ds_lowcomm.configs`): it is replaced by that file's path where it
    was given, for DeepSpeed too. Anything else raises ``FileNotFoundError`` in one line, where
    DeepSpeed 0.19.8 would fail decoding it as base64."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    a = bound.arguments
    key = "config" if a.get("config") is not None else "config_params"
    config = a.get(key)
    args = a.get("args")
    from_args = config is None and getattr(args, "deepspeed_config", None) is not None
    if from_args:
        config = args.deepspeed_config
    if isinstance(config, os.PathLike):
        config = os.fspath(config)  # DeepSpeed's load_ds_config takes a str
    if isinstance(config, str):
        if not os.path.isfile(config) and not _is_base64_json(config):
            config = configs.resolve(config)
        if from_args:
            a["args"] = copy.copy(args)
            a["args"].deepspeed_config = config
        else:
            a[key] = config
    return None if config is None else load_ds_config(config)


def _check_model(model) -> None:
    from deepspeed.moe.layer import MoE
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise LowCommConfigError("model: pipeline parallelism (PipelineModule) is not supported by "
                                 "ds_lowcomm; remove the \"lowcomm\" section to use DeepSpeed's pipeline engine")
    if any(isinstance(m, MoE) for m in model.modules()):
        raise LowCommConfigError("model: DeepSpeed MoE layers are not supported by ds_lowcomm")


def warn_shared_rendezvous_store(env) -> bool:
    """On a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) whose workers share the agent's
    TCP store (torch's default with c10d rendezvous), say once per node that the restarted process
    group may read the previous round's addresses and fail to connect ("Connection refused"), and
    the fix. torch (2.5 to 2.13 at least) reuses the rendezvous host's store across rounds without a
    per-round prefix (pytorch/pytorch#135712). Returns whether it warned."""
    restarted = env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    if not (restarted and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return False
    if env.get("LOCAL_RANK", "0") == "0":
        logging.getLogger("ds_lowcomm").warning(
            "ds_lowcomm: torchrun restart with the agent's shared TCP store: torch can hand this round "
            "the previous round's addresses (a gloo/NCCL 'Connection refused' at init); launch torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")
    return True


@functools.wraps(_original_initialize)
def initialize(*args, **kwargs):
    """``deepspeed.initialize`` (same signature and return value), with a :class:`LowCommEngine`
    when the config has a ``"lowcomm"`` section.

    Validates the whole config first (raises :class:`LowCommConfigError`), initialises
    torch.distributed with ``lowcomm.collective_timeout_s`` if nobody has, and builds the engine
    with a copy of the config at ZeRO stage 0. Collective: DeepSpeed's broadcast of the model from
    rank 0 (as stock), and the mode's process groups.
    """
    bound = inspect.signature(_original_initialize).bind(*args, **kwargs)
    ds_config = _resolve_config(bound)
    if ds_config is not None:
        check_section_name(ds_config)
    if ds_config is None or SECTION not in ds_config:
        return _original_initialize(*bound.args, **bound.kwargs)
    check_deepspeed_version(deepspeed.__version__)
    cfg = parse(ds_config, MODES)
    warn_one_hardware_queue(cfg, MODES, os.environ)  # CUDA_DEVICE_MAX_CONNECTIONS=1 and an overlapping mode
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
        warn_shared_rendezvous_store(os.environ)
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   timeout=timedelta(seconds=cfg.collective_timeout_s))

    stage0 = copy.deepcopy(ds_config)
    stage0["zero_optimization"]["stage"] = 0
    if str(stage0.get("optimizer", {}).get("type", "")).lower() == "lowcommadamw":
        # The custom type name makes stock DeepSpeed fail loudly when ds_lowcomm is not loaded.
        stage0["optimizer"]["type"] = "AdamW"
    _unsynchronized_throughput_timer(stage0)
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
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addFilter(_quiet)
    try:
        return _original_initialize(*bound.args, **bound.kwargs)
    finally:
        deepspeed.DeepSpeedEngine = saved
        ds_logger.removeFilter(_quiet)


def _unsynchronized_throughput_timer(ds_config: dict) -> None:
    """DeepSpeed's throughput timer (0.19.8: ``timers.throughput``, on and ``synchronized`` by
    default) synchronizes the whole device at every forward pass and every ``engine.step`` from
    the third step on (``ThroughputTimer.start``/``stop``): each forward would wait for the
    collectives the comm worker has in flight (zero1 and demo overlap, desloc's streamed syncs)
    and the host could never run ahead. It times on the host clock instead, unless the config
    says otherwise; a config that asks for the synchronization keeps it, with a warning."""
    throughput = ds_config.setdefault("timers", {}).setdefault("throughput", {})  # objects: parse refused others
    if throughput.setdefault("synchronized", False) and throughput.get("enabled", True) \
            and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        logging.getLogger("ds_lowcomm").warning(
            "ds_lowcomm: timers.throughput.synchronized is true: DeepSpeed then synchronizes the device at "
            "every forward pass and step, which exposes the communication the modes overlap; remove it "
            "(ds_lowcomm sets it false) to keep the overlap")


#: DeepSpeed (0.19.8) warnings, once per rank while the engine is built, that say nothing to a
#: user of ours: its LR schedulers read their rate at construction, before their first step.
QUIET = ("Attempting to get learning rate from scheduler before it has started",)


def _quiet(record: logging.LogRecord) -> bool:
    return not any(record.getMessage().startswith(q) for q in QUIET)


def install() -> None:
    """Make ``deepspeed.initialize`` this function (idempotent)."""
    deepspeed.initialize = initialize
