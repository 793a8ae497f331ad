"""DCT top-k codec for DeMo: tiles, orthonormal 2-D DCT-II, per-tile top-k, one packed wire buffer.

A flat fp32 vector is cut into ``chunk × chunk`` tiles, zero-padded to whole tiles (never a
smaller chunk, unlike the reference code's divisor rule that can degrade to chunk 1). Two tilings:

* flat (no ``matrices``): tile t holds elements ``t·chunk² … (t+1)·chunk² − 1`` in order, whatever the
  parameter boundaries (as torchtitan-lowcomms tiles a flat shard);
* matrix (``matrices``): each given row-major matrix of the vector is cut into chunk × chunk
  blocks of its own rows and columns (edges padded), the reference DeMo's 2-D tiling; what lies
  outside them (1-D parameters, partial rows at a shard's edges) is tiled flat after them. Views
  and copies only: no index tensor as large as the vector.

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
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import List, Tuple

import torch

from ds_lowcomm.memory import step_chunk_bytes

VALUE_FORMATS = ("bf16", "sign")


@lru_cache(maxsize=8)
def _basis(chunk: int, device: str) -> torch.Tensor:
    """Orthonormal DCT-II matrix D (chunk × chunk): D @ x is the DCT of x, D.T @ y its inverse."""
    n = torch.arange(chunk, dtype=torch.float64)
    d = torch.cos(math.pi / chunk * (n[None, :] + 0.5) * n[:, None]) * math.sqrt(2.0 / chunk)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32).to(device)


def _bit_weights(device: torch.device) -> torch.Tensor:
    """1, 2, 4, …, 128, each bit's weight in a packed byte, made on ``device`` (built from a host
    list, it would be a blocking copy to a GPU in every step)."""
    return torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=device),
                                    torch.arange(8, dtype=torch.uint8, device=device))


@dataclass(frozen=True)
class DctTopK:
    """The codec for vectors of ``numel`` elements (see the module docstring).

    ``matrices``: ``(start, rows, cols)`` row-major matrices of the vector, sorted and disjoint,
    for matrix tiling; empty for flat tiling.
    """

    numel: int
    chunk: int = 64
    topk: int = 32
    values: str = "bf16"
    matrices: Tuple[Tuple[int, int, int], ...] = ()

    def __post_init__(self):
        if not 1 <= self.topk <= self.chunk * self.chunk:
            raise ValueError(f"topk must be in [1, chunk²={self.chunk ** 2}], got {self.topk}")
        if self.values not in VALUE_FORMATS:
            raise ValueError(f"values must be one of {VALUE_FORMATS}, got {self.values!r}")
        end = 0
        for start, rows, cols in self.matrices:
            if start < end or rows < 1 or cols < 1 or start + rows * cols > self.numel:
                raise ValueError(f"matrices must be sorted, disjoint and inside {self.numel} elements; "
                                 f"got {self.matrices}")
            end = start + rows * cols

    def _padded(self, rows: int, cols: int) -> Tuple[int, int]:
        return -(-rows // self.chunk) * self.chunk, -(-cols // self.chunk) * self.chunk

    @cached_property
    def _rest(self) -> List[Tuple[int, int]]:
        """The ranges outside every matrix, in order (tiled flat after the matrices)."""
        out, pos = [], 0
        for start, rows, cols in self.matrices:
            if start > pos:
                out.append((pos, start))
            pos = start + rows * cols
        if pos < self.numel:
            out.append((pos, self.numel))
        return out

    @cached_property
    def tiles(self) -> int:
        """How many ``chunk`` × ``chunk`` tiles cover the shard: the matrices' padded rows and
        columns, then the rest flat."""
        c2 = self.chunk * self.chunk
        in_matrices = sum(R * C for R, C in (self._padded(r, c) for _, r, c in self.matrices))
        rest = sum(b - a for a, b in self._rest)
        return in_matrices // c2 + -(-rest // c2)

    @property
    def index_dtype(self) -> torch.dtype:
        """An index within a tile: 1 byte up to 256 coefficients, else 2."""
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
        if not self.matrices:
            padded = flat.new_zeros(self.tiles * c * c)
            padded[: self.numel] = flat
            return padded.view(self.tiles, c, c)
        parts = []
        for start, rows, cols in self.matrices:
            R, C = self._padded(rows, cols)
            m = torch.nn.functional.pad(flat[start: start + rows * cols].view(rows, cols), (0, C - cols, 0, R - rows))
            parts.append(m.view(R // c, c, C // c, c).transpose(1, 2).reshape(-1))
        parts += [flat[a:b] for a, b in self._rest]
        used = sum(p.numel() for p in parts)
        parts.append(flat.new_zeros(self.tiles * c * c - used))
        return torch.cat(parts).view(self.tiles, c, c)

    def from_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_tiles`: the flat vector (padding dropped)."""
        c, seq = self.chunk, tiles.reshape(-1)
        if not self.matrices:
            return seq[: self.numel]
        flat, pos = tiles.new_empty(self.numel), 0
        for start, rows, cols in self.matrices:
            R, C = self._padded(rows, cols)
            m = seq[pos: pos + R * C].view(R // c, C // c, c, c).transpose(1, 2).reshape(R, C)
            flat[start: start + rows * cols].view(rows, cols).copy_(m[:rows, :cols])
            pos += R * C
        for a, b in self._rest:
            flat[a:b] = seq[pos: pos + b - a]
            pos += b - a
        return flat

    def dct(self, tiles: torch.Tensor) -> torch.Tensor:
        """The 2-D DCT of each tile of ``tiles`` (T, chunk, chunk), as a new tensor."""
        return self._transform(tiles.clone(), inverse=False)

    def idct(self, coeffs: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`dct`, as a new tensor."""
        return self._transform(coeffs.clone(), inverse=True)

    def _transform(self, tiles: torch.Tensor, inverse: bool) -> torch.Tensor:
        """``D X Dᵀ`` (``Dᵀ X D`` when ``inverse``) of each tile, in place, a
        :func:`~ds_lowcomm.memory.step_chunk_bytes` of tiles at a time (8 MiB on the CPU, 64 MiB
        on a GPU): a whole-shard product would hold two more shard-sized fp32
        temporaries (8/S bytes per parameter). The products follow the script's TF32 setting
        (``torch.backends.cuda.matmul``), a process-wide flag this comm-thread code leaves alone:
        sender and receivers decode with the same kernels, so the error feedback stays exact."""
        d = _basis(self.chunk, str(tiles.device))
        left, right = (d.T, d) if inverse else (d, d.T)
        batch = max(1, step_chunk_bytes(tiles.device) // (self.chunk * self.chunk * 4))
        for a in range(0, tiles.shape[0], batch):
            part = tiles[a:a + batch]
            torch.matmul(left @ part, right, out=part)
        return tiles

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Top-k DCT coefficients of each tile of ``flat``, quantised as they will be sent.

        Returns ``(indices (T, k) int64, values (T, k) fp32)``: what the receivers will decode, so
        the sender's error feedback subtracts exactly that.
        """
        coeffs = self._transform(self.to_tiles(flat), inverse=False).reshape(self.tiles, -1)
        idx = torch.empty(self.tiles, self.topk, dtype=torch.int64, device=coeffs.device)
        batch = max(1, step_chunk_bytes(coeffs.device) // (self.chunk * self.chunk * 4))
        for a in range(0, self.tiles, batch):  # |coefficients| a batch of tiles at a time
            part = coeffs[a:a + batch].abs().topk(self.topk, dim=1, sorted=False).indices
            # Sorting makes the selection independent of topk's internal order: a deterministic wire.
            idx[a:a + batch] = part.sort(dim=1).values
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
        return self.from_tiles(self._transform(coeffs.view(self.tiles, self.chunk, self.chunk), inverse=True))

    def pack(self, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """One uint8 buffer of ``payload_bytes`` (layout in the module docstring)."""
        parts = [idx.to(self.index_dtype).reshape(-1).view(torch.uint8)]
        if self.values == "bf16":
            parts.append(vals.to(torch.bfloat16).reshape(-1).view(torch.uint8))
        else:
            bits = (vals.reshape(-1) >= 0).to(torch.uint8)
            pad = (-bits.numel()) % 8
            bits = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8)
            parts.append((bits * _bit_weights(bits.device)).sum(dim=1, dtype=torch.uint8))
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
        bits = (rest[:nbits, None] & _bit_weights(buf.device)).ne(0).reshape(-1)[:n].view(T, k)
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
        # The mean in place: where no payload carries a coefficient, total is 0 and stays 0.
        mean = total.div_(count.clamp_(min=1))
        del count
        return self.from_tiles(self._transform(mean.view(self.tiles, self.chunk, self.chunk), inverse=True))
