"""``examples/train.py``'s training under plain PyTorch DDP, optionally with the PowerSGD hook: the
peers ds_lowcomm is measured against (``python -m ds_lowcomm.bench --modes ddp,ddp-powersgd,...``).

    torchrun --nproc_per_node 2 examples/train_ddp.py --deepspeed ds_configs/deepspeed_zero1.json
    torchrun --nproc_per_node 2 examples/train_ddp.py --deepspeed ds_configs/deepspeed_zero1.json --powersgd-rank 4

Everything but the communication is train.py's own code: model, data, sampler, validation, logs
and result line. The DeepSpeed JSON supplies what DeepSpeed would: micro-batch, accumulation,
clipping, AdamW's hyperparameters and DeepSpeed's own LR scheduler class, stepped where DeepSpeed
steps it. DDP's bucketed all-reduce overlaps the last micro-batch's backward pass; earlier
micro-batches run under ``no_sync``.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402  (examples/train.py: the same model, data, sampler, loop and logs)


class DDPEngine:
    """What train.py's loop uses of a DeepSpeed engine, over ``DistributedDataParallel``.

    ``step()`` is called after every micro-batch, as with DeepSpeed; every
    ``gradient_accumulation_steps``-th is a boundary: gradients (averaged over ranks by DDP, each
    micro-batch's loss divided by the accumulation count as DeepSpeed does) are clipped to the
    global norm, AdamW steps, the LR scheduler steps. Communication per step: one all-reduce of
    the fp32 gradients, 2(W-1)/W · 4P bytes per rank, or PowerSGD's low-rank factors.
    """

    def __init__(self, model: torch.nn.Module, config: dict, powersgd_rank: int, powersgd_warmup: int) -> None:
        from deepspeed.runtime import lr_schedules

        cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
        self.mbs = int(config.get("train_micro_batch_size_per_gpu", 1))
        self.gas = int(config.get("gradient_accumulation_steps", 1))
        self.clip = float(config.get("gradient_clipping", 0.0))
        opt_cfg = config.get("optimizer", {"type": "AdamW", "params": {}})
        if opt_cfg.get("type", "").lower() not in ("adamw", "lowcommadamw"):
            raise SystemExit(f"error: train_ddp.py runs AdamW; the config's optimizer is {opt_cfg.get('type')!r}")
        hp = {k: v for k, v in opt_cfg.get("params", {}).items() if k in ("lr", "betas", "eps", "weight_decay")}
        self.name = "ddp"
        kwargs = {}
        if powersgd_rank:
            # One bucket: with several, gloo can run the hook's chained collectives in different
            # orders on different ranks (a collective mismatch that aborts the run).
            kwargs["bucket_cap_mb"] = 1 << 20
            self.name = "ddp-powersgd"
        self.module = DistributedDataParallel(model.to(self.device), **kwargs)
        if powersgd_rank:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                       start_powerSGD_iter=max(2, powersgd_warmup))
            self.module.register_comm_hook(state, psgd.powerSGD_hook)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), **hp)
        sched = config.get("scheduler")
        self.lr_scheduler = (getattr(lr_schedules, sched["type"])(self.optimizer, **sched.get("params", {}))
                             if sched else None)
        self.global_steps = self.micro_steps = self.skipped_steps = 0

    def _boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def __call__(self, *args, **kwargs):
        # DDP decides in the forward pass whether the coming backward all-reduces.
        with nullcontext() if self._boundary() else self.module.no_sync():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gas).backward()

    def step(self) -> None:
        if self._boundary():
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1
        self.micro_steps += 1

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.mbs

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def destroy(self) -> None:
        """Drop DDP before train.py destroys the process group: a DDP reducer collected after it
        can block the process's exit forever (seen with gloo, torch 2.13)."""
        self.module = self.module.module
        gc.collect()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--powersgd-rank", type=train.at_least(int, 0), default=0,
                    help="PowerSGD matrix approximation rank (0: plain DDP)")
    ap.add_argument("--powersgd-warmup", type=train.at_least(int, 2), default=None,
                    help="optimizer steps of plain all-reduce before compressing (default: the LR "
                         "warm-up, at least 10%% of --max-steps, as PyTorch's PowerSGD docs advise)")
    ours, rest = ap.parse_known_args(argv)
    args = train.parse_args(rest)
    if args.save_dir or args.resume:
        sys.exit("error: train_ddp.py does not checkpoint; drop --save-dir/--resume")
    config = train.load_config(args)
    warmup = ours.powersgd_warmup
    if warmup is None:
        lr_warmup = config.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0)
        warmup = max(2, lr_warmup, args.max_steps // 10)

    def make_engine(_, model):
        return DDPEngine(model, config, ours.powersgd_rank, warmup)

    return train.main(make_engine=make_engine, args=args)


if __name__ == "__main__":
    main()
