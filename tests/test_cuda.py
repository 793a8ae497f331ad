"""The CUDA tier: every mode on a GPU with NCCL, against stock DeepSpeed on the same GPU.

Skipped without a CUDA device (the CPU suite runs everything else); ``tools/gpu_check.py call2``
runs it on a GPU machine. One rank: what one GPU can check (the side stream, events, the fused
AdamW kernel, bf16 and fp16 on the device, host-asynchronous waits); NCCL between GPUs needs more.
"""
import math

import pytest
import torch

import workers
from dist import run_ranks

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = {"DS_ACCELERATOR": "cuda"}
STEPS = 8
#: relative tolerance of zero1 against stock DeepSpeed per dtype: fp32 sums in another order
#: (NCCL, fused kernels), a 2-byte model's rounding of the same sums
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}
MODES = {
    "zero1": {},
    "zero1-overlap": {"zero1": {"overlap": True}},
    "acco": {"acco": {"variant": "acco"}},
    "demo-overlap": {"shard_group_size": 1, "demo": {"overlap": True, "topk": 8, "chunk": 32}},
    "desloc": {"shard_group_size": 1, "desloc": {"param_sync_every": 2, "momentum_sync_every": 4,
                                                  "variance_sync_every": 8}},
    # Newton–Schulz in bf16 on CUDA
    "desloc-muon": {"shard_group_size": 1, "desloc": {"param_sync_every": 2, "inner_optimizer": "muon"}},
}


def _config(mode, dtype):
    cfg = workers.config(None if mode == "stock" else mode.split("-")[0], **MODES.get(mode, {}))
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    return cfg


def _losses(rank, world, mode, dtype):
    engine = workers.build_engine(_config(mode, dtype))
    assert engine.device.type == "cuda", engine.device
    losses = workers.train(engine, STEPS, rank=rank)
    if hasattr(engine, "comm_stats"):
        engine.optimizer.flush()
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    engine.destroy()
    return {"losses": losses, "finite": finite, "device": str(engine.device)}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_zero1_matches_stock_deepspeed_on_the_gpu(dtype):
    stock = run_ranks(_losses, 1, "stock", dtype, env=CUDA)[0]
    ours = run_ranks(_losses, 1, "zero1", dtype, env=CUDA)[0]
    assert ours["finite"] and stock["finite"]
    for a, b in zip(ours["losses"], stock["losses"]):
        assert math.isclose(a, b, rel_tol=TOLERANCE[dtype]), (ours["losses"], stock["losses"])


@pytest.mark.parametrize("mode", [m for m in MODES if m != "zero1"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_mode_trains_on_the_gpu(mode, dtype):
    res = run_ranks(_losses, 1, mode, dtype, env=CUDA)[0]
    assert res["finite"], res
    assert all(math.isfinite(x) for x in res["losses"]), res["losses"]
    assert sum(res["losses"][-3:]) < sum(res["losses"][:3]), res["losses"]


def test_acco_saved_at_two_ranks_resumes_at_one_on_the_gpu(tmp_path):
    """acco's mid-step gradient sums saved by 2 CPU ranks load into the one GPU rank's
    accumulator with their count and weights (added on the device: a CPU tensor of weights was
    added into the CUDA one before), equal to the saved files' sums."""
    from test_checkpoint import _load_per_rank, _save_per_rank

    numel = run_ranks(_save_per_rank, 2, str(tmp_path), "acco")[0]
    tag = next(p for p in tmp_path.iterdir() if p.name.startswith("global_step"))
    saved = [torch.load(tag / f"lowcomm_rank{r:05d}.pt", weights_only=True) for r in range(2)]
    got = run_ranks(_load_per_rank, 1, str(tmp_path), "acco", env=CUDA)[0]
    assert torch.equal(got["accumulator"].cpu(), sum(s["mode"]["accumulator"][:numel] for s in saved))
    assert got["micro_batches"] == sum(s["mode"]["micro_batches"] for s in saved) > 0
    assert all(math.isfinite(x) for x in got["losses"])
