"""The DeMo codec: orthonormal DCT, top-k selection, flat and matrix tiling, pack/unpack, bytes
equal to the formula."""
import pytest
import torch

from ds_lowcomm.modes.dct import DctTopK

pytestmark = pytest.mark.unit


def test_dct_is_orthonormal_and_inverts():
    codec = DctTopK(numel=3 * 64 * 64, chunk=64)
    x = torch.randn(3, 64, 64)
    y = codec.dct(x)
    torch.testing.assert_close(codec.idct(y), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(y.square().sum(), x.square().sum(), rtol=1e-5, atol=0)  # Parseval
    # DCT-II of a constant tile is a single DC coefficient.
    dc = codec.dct(torch.ones(1, 64, 64))
    assert dc[0, 0, 0].item() == pytest.approx(64.0, rel=1e-5) and dc.abs().flatten()[1:].max() < 1e-4


def test_topk_keeps_the_largest_coefficients_and_pads():
    codec = DctTopK(numel=5000, chunk=16, topk=8)  # 5000 -> 20 tiles of 256, last one padded
    assert codec.tiles == 20
    x = torch.randn(5000)
    idx, vals = codec.encode(x)
    coeffs = codec.dct(codec.to_tiles(x)).reshape(20, -1)
    want = coeffs.abs().topk(8, dim=1).values.sort(dim=1).values
    got = coeffs.gather(1, idx).abs().sort(dim=1).values
    assert torch.equal(got, want)
    # With every coefficient kept, dense() reconstructs the input up to bf16 rounding.
    full = DctTopK(numel=5000, chunk=16, topk=256)
    i, v = full.encode(x)
    torch.testing.assert_close(full.dense(i, v), x, rtol=0, atol=0.05)


@pytest.mark.parametrize("chunk,values", [(64, "bf16"), (64, "sign"), (16, "bf16"), (16, "sign")])
def test_pack_roundtrip_and_bytes(chunk, values):
    codec = DctTopK(numel=10_000, chunk=chunk, topk=7, values=values)
    idx, vals = codec.encode(torch.randn(10_000))
    buf = codec.pack(idx, vals)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.payload_bytes
    n, i = codec.tiles * 7, (1 if chunk * chunk <= 256 else 2)
    expected = n * (i + 2) if values == "bf16" else n * i + -(-n // 8) + 2 * codec.tiles
    assert codec.payload_bytes == expected
    idx2, vals2 = codec.unpack(buf)
    assert torch.equal(idx2, idx) and torch.equal(vals2, vals)


def test_decode_mean_averages_over_contributors():
    codec = DctTopK(numel=64, chunk=8, topk=1)
    a = codec.pack(torch.tensor([[3]]), torch.tensor([[2.0]]))
    b = codec.pack(torch.tensor([[3]]), torch.tensor([[4.0]]))
    c = codec.pack(torch.tensor([[5]]), torch.tensor([[1.0]]))
    got = codec.decode_mean([a, b, c])
    want = torch.zeros(1, 64)
    want[0, 3], want[0, 5] = 3.0, 1.0  # index 3: mean of 2 and 4; index 5: only one contributor
    torch.testing.assert_close(got, codec.idct(want.view(1, 8, 8)).reshape(-1))


def test_matrix_tiling_follows_rows_and_columns():
    # A 1-D parameter, a 70 × 100 matrix, a stray tail, a 5 × 8 matrix, in one flat vector.
    a, b = (10, 70, 100), (10 + 7000 + 33, 5, 8)
    numel = b[0] + 40
    codec = DctTopK(numel, chunk=16, topk=8, matrices=(a, b))
    assert codec.tiles == 5 * 7 + 1 + 1  # 70×100 padded to 80×112, 5×8 to 16×16, 43 others
    x = torch.randn(numel)
    tiles = codec.to_tiles(x)
    m = x[10:7010].view(70, 100)
    assert torch.equal(tiles[0], m[:16, :16]) and torch.equal(tiles[1], m[:16, 16:32])
    assert torch.equal(tiles[7], m[16:32, :16])
    edge = tiles[6]  # rows 0-15, columns 96-111: four real columns, the rest padding
    assert torch.equal(edge[:, :4], m[:16, 96:]) and not edge[:, 4:].any()
    assert torch.equal(tiles[35], torch.nn.functional.pad(x[b[0]:b[0] + 40].view(5, 8), (0, 8, 0, 11)))
    rest = torch.cat([x[:10], x[7010:b[0]]])  # 43 elements outside the matrices, tiled flat
    assert torch.equal(tiles[36].flatten()[:43], rest) and not tiles[36].flatten()[43:].any()
    assert torch.equal(codec.from_tiles(tiles), x)  # every element exactly once
    full = DctTopK(numel, chunk=16, topk=256, matrices=(a, b))
    i, v = full.encode(x)
    torch.testing.assert_close(full.dense(i, v), x, rtol=0.01, atol=0.02)
    assert DctTopK(numel, 16, 8, "sign", (a, b)).payload_bytes == 37 * 8 + 37 + 2 * 37
    with pytest.raises(ValueError, match="sorted, disjoint"):
        DctTopK(numel, 16, 8, matrices=(b, a))
