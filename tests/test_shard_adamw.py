"""ShardAdamW against torch.optim.AdamW: a shard cut across two param groups, fed an fp32
gradient as it is or a 2-byte one (the reduced sums kept in place) converted chunk by chunk."""
import pytest
import torch

from ds_lowcomm.shard.flat import ShardLayout
from ds_lowcomm.shard.adamw import ShardAdamW

pytestmark = pytest.mark.unit

GROUPS = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
          dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]


@pytest.mark.parametrize("grad_dtype,factor", [(torch.float32, 1.0), (torch.bfloat16, 0.37), (torch.float16, 2.0 ** -9)],
                         ids=["fp32", "bf16-scaled", "fp16-unscaled"])
def test_step_matches_torch_adamw(grad_dtype, factor):
    # 150 elements in groups [0, 70) and [70, 150), padded to 160, cut in 2 shards of 80: rank 0's
    # shard holds all of group 0 and the start of group 1.
    layout = ShardLayout(150, world=2, rank=0, group_ranges=((0, 70), (70, 150)))
    torch.manual_seed(0)
    flat = torch.randn(layout.padded)
    flat[150:] = 0
    opt = ShardAdamW(layout, flat)
    segs = layout.segments()
    assert [(s.group, s.start, s.end) for s in segs] == [(0, 0, 70), (1, 70, 80)]
    ref_params = [torch.nn.Parameter(opt.master[s.start:s.end].clone()) for s in segs]
    ref = torch.optim.AdamW([{**GROUPS[s.group], "params": [p]} for s, p in zip(segs, ref_params)], fused=True)
    for step in range(3):
        grad = torch.randn(layout.shard_size, generator=torch.Generator().manual_seed(step)).to(grad_dtype)
        for s, p in zip(segs, ref_params):
            p.grad = grad[s.start:s.end].float() * factor
        ref.step()
        if grad_dtype == torch.float32:
            opt.step(grad.clone(), GROUPS)
        else:
            # Chunks of 64 (a multiple of every SIMD width, as the default is): group 0 in two.
            opt.step(grad, GROUPS, factor, chunk=64)
        for s, p in zip(segs, ref_params):
            assert torch.equal(opt.master[s.start:s.end], p.detach())
    assert opt.step_count == 3


def test_fp32_gradient_must_be_scaled_in_place():
    layout = ShardLayout(32, world=1, rank=0, group_ranges=((0, 32),))
    opt = ShardAdamW(layout, torch.zeros(32))
    with pytest.raises(ValueError, match="in place"):
        opt.step(torch.ones(32), GROUPS[:1], 0.5)
