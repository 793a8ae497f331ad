"""Which parameters Muon steps: whole hidden matrices, the embeddings and the head left to AdamW
(its update against the equations: test_desloc.py)."""
import pytest

import workers

pytestmark = pytest.mark.unit


def test_muon_needs_whole_matrices_and_the_model():
    from ds_lowcomm.shard.flat import FlatParams
    from ds_lowcomm.shard.muon import muon_matrices

    model = workers.tiny_gpt2(0)
    whole = FlatParams([{"params": list(model.parameters())}], world=1, rank=0)
    found = muon_matrices(whole, list(model.modules()))
    # 4 per block (c_attn, attn.c_proj, c_fc, mlp.c_proj); wte (tied head) and wpe left to AdamW
    assert [(r, c) for _, r, c, _ in found] == [(32, 96), (32, 32), (32, 128), (128, 32)] * 2
    with pytest.raises(ValueError, match="model's modules"):
        muon_matrices(whole, [])
    model = workers.tiny_gpt2(0)
    halves = FlatParams([{"params": list(model.parameters())}], world=2, rank=0)
    with pytest.raises(ValueError, match="straddles a shard boundary"):
        muon_matrices(halves, list(model.modules()))
