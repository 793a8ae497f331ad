"""What the ranks of the distributed tests run: a tiny real GPT-2 trained through DeepSpeed."""
from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path
from typing import Iterable, List, Optional

import torch

SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"

BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
}


def mode_context(lowcomm: dict, model: torch.nn.Module, gas: int, hp: dict, clip: float = 1.0,
                 paced: bool = False):
    """A mode's :class:`~ds_lowcomm.shard.context.ModeContext` around ``model`` on the process
    group already initialised, built as ``LowCommOptimizer`` builds it, without DeepSpeed: the
    ``"lowcomm"`` section ``lowcomm`` parsed, one param group of ``hp``, a comm worker where the
    mode is asynchronous, a pacer with ``paced``. A verdict is read as its round lands; steps
    are counted in the returned list. Returns ``(cfg, ctx, steps)``; the mode is
    ``MODES[cfg.mode](ctx, cfg.mode_options)``."""
    from ds_lowcomm.comm.collectives import CommStats
    from ds_lowcomm.comm.topology import Topology
    from ds_lowcomm.comm.worker import CommWorker
    from ds_lowcomm.config import parse
    from ds_lowcomm.modes import MODES
    from ds_lowcomm.shard.context import ModeContext
    from ds_lowcomm.shard.flat import FlatParams, GradAccumulator
    from ds_lowcomm.shard.pace import Pacer

    cfg = parse({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
                 "zero_optimization": {"stage": 1}, "lowcomm": lowcomm}, MODES)
    groups = [dict(params=list(model.parameters()), **hp)]
    stats = CommStats()
    topo = Topology.build(cfg.shard_group_size, 60.0, stats)
    flat = FlatParams(groups, topo.shard.world, topo.shard.rank)
    mode_cls = MODES[cfg.mode]
    worker = CommWorker(stats, flat.device) if mode_cls.is_asynchronous(cfg.mode_options) else None
    pacer = (Pacer(mode_cls.pace_block(cfg.mode_options, gas), topo.shard.rank, device=flat.device,
                   host_wait_seconds=lambda: stats.host_wait_seconds) if paced else None)
    steps = [0]
    ctx = ModeContext(flat=flat, grads=GradAccumulator(flat), topology=topo, worker=worker, stats=stats,
                      param_groups=groups, comm_dtype=torch.float32, gradient_clipping=clip,
                      gradient_accumulation_steps=gas, checkpoint_comm=topo.shard.counted_in(CommStats()),
                      _loss_scale=lambda: 1.0, _steps=lambda: steps[0],
                      step_taken=lambda: steps.__setitem__(0, steps[0] + 1), record_step=lambda *verdict: None,
                      land_verdict=lambda rnd: rnd.read_verdict(wait=True), modules=list(model.modules()),
                      pacer=pacer)
    return cfg, ctx, steps


#: every mode's step, deterministic and syncing every step, as the step audits take it:
#: ``config(name.split("-")[0], **STEP_MODES[name])``
STEP_MODES = {
    "zero1": {},
    "zero1-overlap": {"zero1": {"overlap": True}},
    "acco": {"acco": {"variant": "acco", "accumulate_while_waiting": False, "balance": False}},
    "demo-overlap": {"shard_group_size": 1, "demo": {"overlap": True, "topk": 8, "chunk": 32}},
    "desloc": {"shard_group_size": 1, "desloc": {"param_sync_every": 1, "momentum_sync_every": 1,
                                                  "variance_sync_every": 1}},
}


def config(mode: Optional[str] = "zero1", bf16: bool = False, **lowcomm) -> dict:
    cfg = copy.deepcopy(BASE_CONFIG)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if mode is not None:
        cfg["lowcomm"] = {"mode": mode, **lowcomm}
    return cfg


def corpus() -> bytes:
    if SHARED_TEXT.is_file():
        return SHARED_TEXT.read_bytes()
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics.values()).encode()


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(cfg)


def batch(step: int, micro: int, rank: int, mbs: int = 2, block: int = 32) -> torch.Tensor:
    """A deterministic micro-batch of byte tokens: a function of (step, micro, rank) only."""
    data = corpus()
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    starts = torch.randint(0, len(data) - block - 1, (mbs,), generator=g).tolist()
    return torch.tensor([list(data[s: s + block]) for s in starts], dtype=torch.long)


def allow_fp16_on_this_cpu() -> None:
    """DeepSpeed 0.19.8 refuses fp16 on a CPU without mkldnn fp16 kernels
    (``CPU_Accelerator.is_fp16_supported``), though torch computes fp16 on any CPU, only slower.
    The fp16 tests lift that gate in their own processes, for stock DeepSpeed and ds_lowcomm alike."""
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True


def build_engine(cfg: dict, seed: int = 0, model=None):
    import deepspeed

    import ds_lowcomm

    ds_lowcomm.skip_shm_comm_build()
    model = model if model is not None else tiny_gpt2(seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def raised(exc_type, fn, *args, **kwargs) -> Optional[str]:
    """The message of the ``exc_type`` that ``fn(*args, **kwargs)`` raises; None when it returns."""
    try:
        fn(*args, **kwargs)
    except exc_type as err:
        return str(err)
    return None


def params_digest(engine) -> str:
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def micro_batches(engine, start: int, stop: int, rank: int = 0, poison: Optional[dict] = None) -> List[float]:
    """Micro-batches ``start`` to ``stop - 1`` of the DeepSpeed loop (forward, backward and
    ``engine.step()`` each; micro-batch ``j`` is ``batch(j // GAS, j % GAS, rank)``), the one
    micro-batch loop of the tests that drive an engine the way DeepSpeed scripts do. Returns each
    loss. ``poison``: ``{j: factor}``, micro-batch ``j``'s loss multiplied by ``factor`` before
    its backward pass (``nan``, ``inf``, or a huge number for an fp16 overflow)."""
    gas, mbs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    losses = []
    for j in range(start, stop):
        x = batch(j // gas, j % gas, rank, mbs).to(engine.device)
        loss = engine(x, labels=x).loss
        if poison and j in poison:
            loss = loss * poison[j]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train(engine, steps: int, start: int = 0, rank: int = 0, digests: Optional[list] = None,
          poison: Optional[dict] = None, skip: Iterable[int] = ()) -> List[float]:
    """``steps`` optimizer steps of :func:`micro_batches` from step ``start``.

    Returns the mean loss per step on this rank; appends a parameter digest after each step.
    ``poison``: ``{(step, micro): factor}`` (see :func:`micro_batches`). ``skip``: data steps left
    out altogether (the reference "never saw that step").
    """
    gas = engine.gradient_accumulation_steps()
    poison = {step * gas + micro: f for (step, micro), f in (poison or {}).items()}
    losses = []
    for step in range(start, start + steps):
        if step in skip:
            continue
        losses.append(sum(loss / gas for loss in micro_batches(engine, step * gas, (step + 1) * gas, rank, poison)))
        if digests is not None:
            digests.append(params_digest(engine))
    return losses
