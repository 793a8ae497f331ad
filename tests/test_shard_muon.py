"""Which parameters Muon steps: the hidden matrices, the embeddings and the head left to AdamW,
and which matrices a shard boundary cuts (its update against the equations: test_desloc.py)."""
import pytest

import workers

pytestmark = pytest.mark.unit


def test_muon_takes_the_hidden_matrices_and_knows_which_are_cut():
    from ds_lowcomm.shard.flat import FlatParams
    from ds_lowcomm.shard.muon import muon_matrices

    model = workers.tiny_gpt2(0)
    whole = FlatParams([{"params": list(model.parameters())}], world=1, rank=0)
    found = muon_matrices(whole, list(model.modules()))
    # 4 per block (c_attn, attn.c_proj, c_fc, mlp.c_proj); wte (tied head) and wpe left to AdamW
    assert [(m.rows, m.cols) for m in found] == [(32, 96), (32, 32), (32, 128), (128, 32)] * 2
    assert not any(m.cut for m in found)
    with pytest.raises(ValueError, match="model's modules"):
        muon_matrices(whole, [])

    model = workers.tiny_gpt2(0)
    params = list(model.parameters())
    halves = FlatParams([{"params": params}], world=2, rank=0)
    boundary = halves.layout.shard_size
    cut = [m for m in muon_matrices(halves, list(model.modules())) if m.cut]
    assert len(cut) == 1 and cut[0].start < boundary < cut[0].end


def test_an_untied_head_stays_with_adamw():
    """A Hugging Face model whose output head is its own matrix (not tied to the embedding): the
    head is an embedding in Muon's sense and is left to AdamW, like the token embedding."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_lowcomm.shard.flat import FlatParams
    from ds_lowcomm.shard.muon import muon_matrices

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       tie_word_embeddings=False))
    params = list(model.parameters())
    assert any(p is model.lm_head.weight for p in params)  # its own parameter
    flat = FlatParams([{"params": params}], world=1, rank=0)
    head = flat.offsets[id(model.lm_head.weight)]
    found = muon_matrices(flat, list(model.modules()))
    assert [(m.rows, m.cols) for m in found] == [(32, 96), (32, 32), (32, 128), (128, 32)]
    assert all(m.start != head for m in found)


def test_a_streamed_moment_decays_by_each_parts_own_rate():
    """What n updates leave of a moment's earlier value (a streamed sync's correction): Muon's
    momentum 0.95^n on the hidden matrices, which have no second moment (left as it is); elsewhere
    AdamW's β1^n or β2^n, each param group by its own betas. The matrices are named here, not
    taken from the library."""
    import torch

    from ds_lowcomm.shard.flat import FlatParams
    from ds_lowcomm.shard.muon import ShardMuon, muon_matrices

    model = workers.tiny_gpt2(0)
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named[:9]], "betas": (0.9, 0.95)},
              {"params": [p for _, p in named[9:]], "betas": (0.8, 0.99)}]
    flat = FlatParams([{"params": g["params"]} for g in groups], world=1, rank=0)
    muon = ShardMuon(flat.layout, flat.buffer, muon_matrices(flat, list(model.modules())), None)
    hidden = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
    for key, which in (("exp_avg", 0), ("exp_avg_sq", 1)):
        values = torch.ones(flat.layout.shard_size)
        muon.decay(key, values, 3, groups)
        want = torch.ones_like(values)
        for i, (name, p) in enumerate(named):
            a = flat.offsets[id(p)]
            if name.endswith(hidden):
                rate = 0.95 if key == "exp_avg" else 1.0
            else:
                rate = groups[0 if i < 9 else 1]["betas"][which]
            want[a:a + p.numel()] = rate ** 3
        assert torch.equal(values, want), key


def test_whole_matrices_are_orthogonalised_in_batches_of_one_shape(monkeypatch):
    """The shard's whole matrices go to Newton–Schulz a batch of one shape at a time, each batch
    at most ``NS_BATCH_ELEMENTS`` elements (a larger matrix alone), so the stacked temporaries
    never grow with the model; a matrix a shard boundary cuts is never in a batch (it is made
    whole by its all-reduce first). Shapes written from the tiny GPT-2's blocks, not taken from
    the library."""
    import ds_lowcomm.shard.muon as muon
    from ds_lowcomm.shard.flat import FlatParams

    def shapes(world, rank):
        model = workers.tiny_gpt2(0)
        flat = FlatParams([{"params": list(model.parameters())}], world=world, rank=rank)
        found = muon.muon_matrices(flat, list(model.modules()))
        opt = muon.ShardMuon(flat.layout, flat.buffer, found, None)
        starts = [m.start for b in opt.batches for m in b]
        assert len(starts) == len(set(starts)) and not any(m.cut for b in opt.batches for m in b)
        return [[(m.rows, m.cols) for m in b] for b in opt.batches]

    c_attn, c_proj, c_fc, mlp_proj = (32, 96), (32, 32), (32, 128), (128, 32)
    assert shapes(1, 0) == [[c_attn] * 2, [c_proj] * 2, [c_fc] * 2, [mlp_proj] * 2]
    bound = muon.NS_BATCH_ELEMENTS
    monkeypatch.setattr(muon, "NS_BATCH_ELEMENTS", 32 * 96)
    assert shapes(1, 0) == [[c_attn], [c_attn], [c_proj] * 2, [c_fc], [c_fc], [mlp_proj], [mlp_proj]]
    # two shards: each holds its whole matrices, the cut one in neither's batches
    monkeypatch.setattr(muon, "NS_BATCH_ELEMENTS", bound)
    halves = shapes(2, 0) + shapes(2, 1)
    assert sum(len(b) for b in halves) == 8 - 1


def test_compressed_moment_syncs_carry_the_ranges_muon_fills():
    """desloc's compressed moment syncs under Muon, on the last of 3 shards (a matrix cut at its
    start, padding at its end): the first moment's over every parameter element of the shard
    (Muon's momentum on the matrices, Adam's elsewhere), the second moment's over the elements
    left to AdamW only (the matrices' stays zero); the padding in neither. The ranges are named
    here from the model, not taken from the library."""
    import torch

    from ds_lowcomm.modes.desloc import DeslocOptions, ReplicaSyncs
    from ds_lowcomm.shard.flat import FlatParams
    from ds_lowcomm.shard.muon import ShardMuon, muon_matrices

    model = workers.tiny_gpt2(0)
    named = list(model.named_parameters())
    flat = FlatParams([{"params": [p for _, p in named]}], world=3, rank=2)
    muon = ShardMuon(flat.layout, flat.buffer, muon_matrices(flat, list(model.modules())), None)
    options = DeslocOptions(param_sync_every=2, momentum_sync_every=2, variance_sync_every=4, moment_sync_topk=2,
                            sync_chunk=8)
    syncs = ReplicaSyncs(options, muon).moment_syncs
    lo, size = flat.layout.shard_start, flat.layout.shard_size
    hidden = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
    real = sum(p.numel() for _, p in named) - lo  # this shard's parameter elements
    assert 0 < real < size  # there is padding
    assert any(name.endswith(hidden) and flat.offsets[id(p)] < lo < flat.offsets[id(p)] + p.numel()
               for name, p in named)  # a matrix cut at the shard's start
    reference = {"exp_avg": torch.zeros(size, dtype=torch.bool), "exp_avg_sq": torch.zeros(size, dtype=torch.bool)}
    reference["exp_avg"][:real] = True
    for name, p in named:
        a, b = flat.offsets[id(p)] - lo, flat.offsets[id(p)] + p.numel() - lo
        if not name.endswith(hidden) and b > 0:
            reference["exp_avg_sq"][max(a, 0):b] = True
    for key, want in reference.items():
        covered = torch.zeros(size, dtype=torch.bool)
        for a, b in syncs[key].ranges:
            assert not covered[a:b].any(), key  # no element twice
            covered[a:b] = True
        assert torch.equal(covered, want), key
        assert syncs[key].codec.numel == int(want.sum()), key
