"""FlatParams: one padded flat buffer cut into equal shards, and the whole matrix rows in a shard
(what DeMo's matrix tiling tiles)."""
import pytest
import torch

from ds_lowcomm.shard.flat import FlatParams, GradAccumulator

pytestmark = pytest.mark.unit


def _params():
    shapes = [(10,), (7, 5), (3,), (2, 3, 4)]  # at flat offsets 0, 10, 45, 48; 72 elements
    return [torch.nn.Parameter(torch.zeros(s)) for s in shapes]


def test_matrix_rows_in_each_shard():
    # 3 shards of 32 (72 padded to 96): row 4 of the 7 × 5 matrix (elements 30-34) straddles
    # shards 0 and 1, so neither counts it; the 3-D tensor is 6 rows of 4.
    want = {0: [(10, 4, 5)], 1: [(3, 2, 5), (16, 4, 4)], 2: [(0, 2, 4)]}
    for rank in range(3):
        flat = FlatParams([{"params": _params()}], world=3, rank=rank)
        assert flat.layout.shard_size == 32
        assert flat.matrix_rows_in_shard() == want[rank]


def test_one_shard_holds_every_matrix_whole():
    flat = FlatParams([{"params": _params()}], world=1, rank=0)
    assert flat.matrix_rows_in_shard() == [(10, 7, 5), (48, 6, 4)]


def test_mixed_parameter_dtypes_are_refused():
    """A module whose parameters stay fp32 in a bf16 model (what keep_in_fp32 would do to
    parameters) cannot share one flat buffer: a clear error, not a silent cast."""
    params = _params()
    params[1].data = params[1].data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"one dtype.*torch.bfloat16.*torch.float32"):
        FlatParams([{"params": params}], world=1, rank=0)


@pytest.mark.parametrize("dtype,accum", [(torch.float32, None), (torch.bfloat16, None),
                                         (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "bf16-fp32-sums"])
def test_grad_accumulator_sums_micro_batches_whoever_resets_p_grad(dtype, accum):
    """The sums equal the gradients autograd gives an independent copy of the parameters, added
    up micro-batch by micro-batch in the sums' dtype (by default the parameters', as stock
    DeepSpeed sums them), even when someone sets ``p.grad`` to None between micro-batches (a
    module's ``zero_grad()``). Sums in the parameters' dtype are ``p.grad`` itself, the
    parameter's slice of the buffer: autograd adds into them in place, nothing else is kept.
    fp32 sums of bf16 parameters are added by the hook, which frees ``p.grad``."""
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(p.shape).to(dtype)) for p in _params()]
    params = [torch.nn.Parameter(r.detach().clone()) for r in ref]
    flat = FlatParams([{"params": params}], world=2, rank=0)
    acc = GradAccumulator(flat, accum)
    sums = accum or dtype
    assert acc.buffer.dtype == sums
    want = torch.zeros(flat.layout.numel, dtype=sums)
    for micro in range(3):
        x = torch.randn(4, dtype=torch.float64)
        loss_of = lambda ps: sum((p.to(torch.float64).sum() * x[i]) ** 2 for i, p in enumerate(ps))  # noqa: E731
        grads = torch.autograd.grad(loss_of(ref), ref)
        want += torch.cat([g.flatten() for g in grads]).to(sums)
        loss_of(params).backward()
        if sums == dtype:
            assert all(p.grad.untyped_storage().data_ptr() == acc.buffer.untyped_storage().data_ptr()
                       for p in params)
        else:
            assert all(p.grad is None for p in params)
        if micro == 1:
            for p in params:
                p.grad = None
    assert torch.equal(acc.buffer[: flat.layout.numel], want)
    assert acc.buffer[flat.layout.numel:].abs().sum() == 0  # padding stays zero


def test_grad_accumulator_refuses_a_third_dtype():
    flat = FlatParams([{"params": [p.to(torch.bfloat16) for p in _params()]}], world=1, rank=0)
    with pytest.raises(ValueError, match="summed in fp32 or in torch.bfloat16"):
        GradAccumulator(flat, torch.float16)
