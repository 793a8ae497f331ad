"""DCT top-k codec for DeMo: tiles, orthonormal 2-D DCT-II, per-tile top-k, one packed wire buffer.

A flat fp32 vector is cut into ``chunk × chunk`` tiles, zero-padded to whole tiles (never a
smaller chunk, unlike the reference code's divisor rule that can degrade to chunk 1). Two tilings:

* flat (default): tile t holds elements ``t·chunk² … (t+1)·chunk² − 1`` in order, whatever the
  parameter boundaries (as torchtitan-lowcomms tiles a flat shard);
* matrix (:func:`matrix_tile_index`): each weight matrix is cut into chunk × chunk blocks of its
  own rows and columns (edges padded), the reference DeMo's 2-D tiling; what is not a whole matrix
  row (1-D parameters, partial rows at a shard's edges) is tiled flat after them.

Each tile gets an orthonormal 2-D DCT-II (``D X Dᵀ`` with a cached basis: two batched matrix
products, fast on CPU and GPU); its ``topk`` largest-magnitude coefficients are kept.

Wire format of one rank's payload (one ``uint8`` buffer per step, all parameters together), for T
tiles and k coefficients per tile:

=========  ==========================================  =================================
values     layout                                      bytes
=========  ==========================================  =================================
``bf16``   indices (T·k, uint8 if chunk² ≤ 256 else      T·k·(i + 2)
           int16) ‖ values (T·k bf16)
``sign``   indices ‖ sign bits (T·k, packed 8 per       T·k·i + ceil(T·k / 8) + 2·T
           byte) ‖ one bf16 scale per tile (the mean
           |coefficient| kept in the tile)
=========  ==========================================  =================================

where i is the index size in bytes. Decoding is deterministic (a fixed summation order), so every
replica that decodes the same gathered buffers computes bit-identical results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import torch

VALUE_FORMATS = ("bf16", "sign")


@lru_cache(maxsize=8)
def _basis(chunk: int, device: str) -> torch.Tensor:
    """Orthonormal DCT-II matrix D (chunk × chunk): D @ x is the DCT of x, D.T @ y its inverse."""
    n = torch.arange(chunk, dtype=torch.float64)
    d = torch.cos(math.pi / chunk * (n[None, :] + 0.5) * n[:, None]) * math.sqrt(2.0 / chunk)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32).to(device)


def matrix_tile_index(numel: int, blocks: Sequence[Tuple[int, int, int]], chunk: int) -> torch.Tensor:
    """Tile layout following matrix structure, for :class:`DctTopK`'s ``tile_index``.

    ``blocks``: non-overlapping ``(start, rows, cols)`` row-major matrices inside a flat vector of
    ``numel`` elements. Returns, tile after tile, the flat position of every tile element; padding
    points at ``numel`` (read as zero, written nowhere). Elements outside every block follow in
    order, tiled flat.
    """
    c = chunk
    parts, covered = [], torch.zeros(numel, dtype=torch.bool)
    for start, rows, cols in blocks:
        R, C = -(-rows // c) * c, -(-cols // c) * c
        grid = torch.full((R, C), numel, dtype=torch.int64)
        grid[:rows, :cols] = torch.arange(start, start + rows * cols).view(rows, cols)
        parts.append(grid.view(R // c, c, C // c, c).permute(0, 2, 1, 3).reshape(-1))
        covered[start: start + rows * cols] = True
    rest = (~covered).nonzero().squeeze(1)
    parts += [rest, torch.full(((-rest.numel()) % (c * c),), numel, dtype=torch.int64)]
    return torch.cat(parts)


@dataclass(frozen=True)
class DctTopK:
    """The codec for vectors of ``numel`` elements (see the module docstring).

    ``tile_index``: None for flat tiling, else :func:`matrix_tile_index`'s layout.
    """

    numel: int
    chunk: int = 64
    topk: int = 32
    values: str = "bf16"
    tile_index: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 1 <= self.topk <= self.chunk * self.chunk:
            raise ValueError(f"topk must be in [1, chunk²={self.chunk ** 2}], got {self.topk}")
        if self.values not in VALUE_FORMATS:
            raise ValueError(f"values must be one of {VALUE_FORMATS}, got {self.values!r}")
        if self.tile_index is not None and self.tile_index.numel() % (self.chunk * self.chunk):
            raise ValueError("tile_index must hold whole tiles")

    @property
    def tiles(self) -> int:
        if self.tile_index is not None:
            return self.tile_index.numel() // (self.chunk * self.chunk)
        return -(-self.numel // (self.chunk * self.chunk))

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.uint8 if self.chunk * self.chunk <= 256 else torch.int16

    @property
    def payload_bytes(self) -> int:
        """Bytes of one rank's packed payload (the formula in the module docstring)."""
        n = self.tiles * self.topk
        i = 1 if self.index_dtype == torch.uint8 else 2
        if self.values == "bf16":
            return n * (i + 2)
        return n * i + -(-n // 8) + 2 * self.tiles

    # -- transforms ---------------------------------------------------------------------------

    def to_tiles(self, flat: torch.Tensor) -> torch.Tensor:
        """The flat vector laid out as (T, chunk, chunk) tiles, zero-padded."""
        c = self.chunk
        if self.tile_index is not None:
            padded = torch.cat([flat, flat.new_zeros(1)])
            return padded[self.tile_index.to(flat.device)].view(self.tiles, c, c)
        padded = flat.new_zeros(self.tiles * c * c)
        padded[: self.numel] = flat
        return padded.view(self.tiles, c, c)

    def from_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_tiles`: the flat vector (padding dropped)."""
        if self.tile_index is None:
            return tiles.reshape(-1)[: self.numel]
        flat = tiles.new_empty(self.numel + 1)
        flat[self.tile_index.to(tiles.device)] = tiles.reshape(-1)  # padding all lands on [numel]
        return flat[: self.numel]

    def dct(self, tiles: torch.Tensor) -> torch.Tensor:
        d = _basis(self.chunk, str(tiles.device))
        return d @ tiles @ d.T

    def idct(self, coeffs: torch.Tensor) -> torch.Tensor:
        d = _basis(self.chunk, str(coeffs.device))
        return d.T @ coeffs @ d

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Top-k DCT coefficients of each tile of ``flat``, quantised as they will be sent.

        Returns ``(indices (T, k) int64, values (T, k) fp32)``: what the receivers will decode, so
        the sender's error feedback subtracts exactly that.
        """
        coeffs = self.dct(self.to_tiles(flat)).reshape(self.tiles, -1)
        idx = coeffs.abs().topk(self.topk, dim=1, sorted=False).indices
        # Sorting makes the selection independent of topk's internal order: a deterministic wire.
        idx = idx.sort(dim=1).values
        vals = coeffs.gather(1, idx)
        if self.values == "bf16":
            vals = vals.to(torch.bfloat16).float()
        else:
            scale = vals.abs().mean(dim=1, keepdim=True).to(torch.bfloat16).float()
            vals = torch.where(vals >= 0, scale, -scale)
        return idx, vals

    def dense(self, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """The flat vector whose tiles' DCT holds ``vals`` at ``idx`` and zero elsewhere."""
        coeffs = torch.zeros(self.tiles, self.chunk * self.chunk, dtype=torch.float32, device=vals.device)
        coeffs.scatter_(1, idx, vals)
        return self.from_tiles(self.idct(coeffs.view(self.tiles, self.chunk, self.chunk)))

    def pack(self, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """One uint8 buffer of ``payload_bytes`` (layout in the module docstring)."""
        parts = [idx.to(self.index_dtype).reshape(-1).view(torch.uint8)]
        if self.values == "bf16":
            parts.append(vals.to(torch.bfloat16).reshape(-1).view(torch.uint8))
        else:
            bits = (vals.reshape(-1) >= 0).to(torch.uint8)
            pad = (-bits.numel()) % 8
            bits = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8)
            weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
            parts.append((bits * weights).sum(dim=1, dtype=torch.uint8))
            parts.append(vals.abs()[:, 0].to(torch.bfloat16).view(torch.uint8))
        out = torch.cat(parts)
        assert out.numel() == self.payload_bytes
        return out

    def unpack(self, buf: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`pack`: ``(indices (T, k) int64, values (T, k) fp32)``."""
        n, T, k = self.tiles * self.topk, self.tiles, self.topk
        i = torch.tensor([], dtype=self.index_dtype).element_size()
        # Slices are cloned before being viewed as wider types: a view needs an aligned offset.
        idx = buf[: n * i].clone().view(self.index_dtype).to(torch.int64).view(T, k)
        rest = buf[n * i:]
        if self.values == "bf16":
            return idx, rest[: 2 * n].clone().view(torch.bfloat16).float().view(T, k)
        nbits = -(-n // 8)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=buf.device)
        bits = (rest[:nbits, None] & weights).ne(0).reshape(-1)[:n].view(T, k)
        scale = rest[nbits: nbits + 2 * T].clone().view(torch.bfloat16).float().view(T, 1)
        return idx, torch.where(bits, scale, -scale)

    def decode_mean(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Flat vector: IDCT of, per coefficient, the mean over the payloads that carry it.

        Summed in the order given (replica order), the same on every rank: replicas agree bit for bit.
        """
        total = torch.zeros(self.tiles, self.chunk * self.chunk, dtype=torch.float32, device=payloads[0].device)
        count = torch.zeros_like(total)
        for buf in payloads:
            idx, vals = self.unpack(buf)
            total.scatter_add_(1, idx, vals)
            count.scatter_add_(1, idx, torch.ones_like(vals))
        mean = torch.where(count > 0, total / count.clamp(min=1), total)
        return self.from_tiles(self.idct(mean.view(self.tiles, self.chunk, self.chunk)))
