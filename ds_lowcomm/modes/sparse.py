"""Chunked top-k with error feedback: desloc's compressed parameter syncs, and the wire format
its compressed moment syncs share (``ChunkTopK``: there the moment's change since the last sync,
s_r − anchor, is encoded in u_r's place, and what is not sent stays in the moment itself, in e_r's;
see ``desloc.MomentSync``).

SparseLoCo's outer step (Sarfi et al., arXiv 2508.15706) on DES-LOC's parameter average. At a
parameter sync each replica r has made local progress ``anchor − master_r`` since the last sync
(``anchor``: the parameters every replica agreed on then). Instead of all-reducing its master, it
sends a compressed pseudo-gradient and keeps what it did not send:

    u_r      = e_r + (anchor − master_r)                 error feedback added (eq. 3)
    I_r      = per chunk of C elements, the k largest |u_r|
    v̂_r      = u_r[I_r] rounded to the wire's values (bf16; int8 on a per-chunk absmax scale; or
               int2: a sign and one of two magnitudes per group of chunks, see below)
    e_r      = u_r − scatter(I_r, v̂_r)                   what was not sent stays, exactly
    Δ        = (Σ_r scatter(I_r, v̂_r)) / R               identical on every replica
    anchor  −= Δ (plain), or the outer Nesterov step on Δ; every master_r = anchor

Each replica's (I_r, v̂_r[, scales]) travel in one all-gather of bytes over the replica group:
per chunk k·(index + value) bytes (index: 1 byte for C ≤ 256, else 2; value: 2 bytes bf16, 1 int8)
plus 4 bytes of scale per chunk with int8, against 8·C bytes of a dense fp32 all-reduce per chunk
(ring, R = 2). With int2 (C ≤ 64) an entry is one byte, its 6-bit index, sign and magnitude bit
together, plus 8 bytes per group of ``INT2_GROUP`` chunks: k + 8/16 bytes per chunk. The work is
done a block of chunks at a time (``memory.CHUNK_BYTES``): nothing shard-sized is allocated beyond
the error buffer itself.

int2 is 2-bit quantisation as SparseLoCo and MuLoCo send (4 levels), with the levels fitted to
each group's picked values rather than spaced evenly: one step of Lloyd's algorithm from the
mean. For the picked values v of a group, t = mean |v|; hi = mean of the |v| ≥ t, lo = mean of the
|v| < t (t where a side is empty); v̂ = sign(v)·(hi if |v| ≥ t else lo), a zero counted positive.
Each level is the mean of its side's magnitudes, so the magnitudes' rounding errors sum to zero
per side and group; top-k values are heavy-tailed, where even levels over [−max, max] would round
most of them far off. A picked zero (only where a chunk has fewer than k non-zeros) goes as +lo,
its error −lo kept like any other.
"""
from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

from ds_lowcomm.memory import CHUNK_BYTES, temporary

#: the largest chunk: indices travel as int16 above 256 elements
MAX_CHUNK = 1 << 15
INT8_LEVELS = 127
#: int2: chunks per group sharing one (lo, hi) pair of fp32 magnitudes
INT2_GROUP = 16
#: int2: the largest chunk (a 6-bit index shares the byte with the sign and the magnitude bit)
INT2_MAX_CHUNK = 64
INT2_INDEX_MASK = INT2_MAX_CHUNK - 1
VALUES = ("bf16", "int8", "int2")


class ChunkTopK:
    """The wire format of one replica's compressed sync of ``numel`` elements: chunks of ``chunk``
    elements (the last one padded with zeros: in the error buffer of a parameter sync, in the
    scratch a moment sync packs into), ``topk`` values per chunk in ``values`` ("bf16", "int8" or
    "int2")."""

    def __init__(self, numel: int, chunk: int, topk: int, values: str) -> None:
        if not 1 <= topk <= chunk <= MAX_CHUNK:
            raise ValueError(f"need 1 <= topk <= chunk <= {MAX_CHUNK}; got topk {topk}, chunk {chunk}")
        if values not in VALUES:
            raise ValueError(f"values: one of {VALUES}, got {values!r}")
        if values == "int2" and chunk > INT2_MAX_CHUNK:
            raise ValueError(f"int2 values need chunk <= {INT2_MAX_CHUNK} (index, sign and level share a "
                             f"byte); got chunk {chunk}")
        self.numel, self.chunk, self.topk, self.values = numel, chunk, topk, values
        self.chunks = -(-numel // chunk)
        self.groups = -(-self.chunks // INT2_GROUP)
        self.index_dtype = torch.uint8 if chunk <= 256 else torch.int16
        n = self.chunks * topk
        scales = {"bf16": 0, "int8": self.chunks, "int2": 2 * self.groups}[values]
        # Sections ordered by element size, so every section starts aligned for its dtype.
        sizes = [("scales", torch.float32, scales), ("index", self.index_dtype, n)]
        if values != "int2":  # (int2's values travel in the index bytes)
            sizes.append(("values", torch.bfloat16 if values == "bf16" else torch.int8, n))
        sizes.sort(key=lambda s: -torch.empty((), dtype=s[1]).element_size())
        self.sections: List[Tuple[str, torch.dtype, int, int]] = []
        offset = 0
        for name, dtype, count in sizes:
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            self.sections.append((name, dtype, offset, nbytes))
            offset += nbytes
        # Whole elements of the widest section, so each replica's payload in an all-gathered
        # buffer starts aligned too.
        align = max(torch.empty((), dtype=dtype).element_size() for _, dtype, _, nbytes in self.sections if nbytes)
        self.payload_bytes = -(-offset // align) * align

    @property
    def padded(self) -> int:
        """Elements of the error buffer: whole chunks."""
        return self.chunks * self.chunk

    def views(self, payload: torch.Tensor) -> dict:
        """``payload`` (uint8, :attr:`payload_bytes`) as its ``scales``, ``index`` and ``values``
        tensors, chunk-major (``[chunks, topk]``; scales ``[chunks]`` with int8, ``[groups, 2]``
        (lo, hi) with int2, None with bf16; int2 has no ``values``: its index bytes carry them)."""
        out = {"scales": None}  # (bf16 values have none)
        for name, dtype, offset, nbytes in self.sections:
            if not nbytes:
                continue
            part = payload[offset:offset + nbytes].view(dtype)
            if name == "scales":
                out[name] = part.view(self.groups, 2) if self.values == "int2" else part
            else:
                out[name] = part.view(self.chunks, self.topk)
        return out

    def row_blocks(self) -> Iterator[Tuple[int, int]]:
        """Chunk rows ``[r0, r1)`` a block at a time, ``CHUNK_BYTES`` of fp32 per block; with int2,
        whole groups of chunks."""
        rows = max(1, CHUNK_BYTES // (4 * self.chunk))
        if self.values == "int2":
            rows = max(INT2_GROUP, rows // INT2_GROUP * INT2_GROUP)
        for r0 in range(0, self.chunks, rows):
            yield r0, min(self.chunks, r0 + rows)

    def indices(self, view: dict, r0: int, r1: int) -> torch.Tensor:
        """The picked elements' positions in their chunks, rows ``r0:r1``, ``[r1 − r0, topk]`` int64."""
        index = view["index"][r0:r1]
        return (index & INT2_INDEX_MASK if self.values == "int2" else index).long()

    def dequantize(self, view: dict, r0: int, r1: int) -> torch.Tensor:
        """The fp32 values rows ``r0:r1`` of a payload ``view`` stand for, ``[r1 − r0, topk]``."""
        if self.values == "int2":
            code = view["index"][r0:r1]
            group = torch.arange(r0, r1, device=code.device) // INT2_GROUP
            lo_hi = view["scales"][group]  # [rows, 2]
            high = (code >> 7).bool()
            magnitude = torch.where(high, lo_hi[:, 1:], lo_hi[:, :1])
            return torch.where((code >> 6 & 1).bool(), -magnitude, magnitude)
        vals = view["values"][r0:r1].float()
        if self.values == "int8":
            vals.mul_((view["scales"][r0:r1] / INT8_LEVELS).unsqueeze(1))
        return vals

    def encode_int2(self, view: dict, r0: int, r1: int, idx: torch.Tensor, picked: torch.Tensor) -> None:
        """Rows ``r0:r1`` (whole groups) of ``picked`` values at ``idx`` into the int2 payload
        ``view``: each group's (lo, hi) and each entry's byte, index | negative << 6 | high << 7."""
        assert r0 % INT2_GROUP == 0, "int2 encodes whole groups of chunks"
        rows = r1 - r0
        whole = rows // INT2_GROUP * INT2_GROUP
        count = -(-rows // INT2_GROUP)
        group = torch.arange(rows, device=picked.device) // INT2_GROUP
        magnitude = picked.abs()

        def group_sum(x):  # [rows, topk] → [count]; a fixed order (index_add_ is atomic on CUDA)
            x = x.float()
            sums = [x[:whole].reshape(-1, INT2_GROUP * self.topk).sum(1)]
            if whole < rows:
                sums.append(x[whole:].sum().reshape(1))
            return torch.cat(sums)

        mean = group_sum(magnitude) / group_sum(torch.ones_like(magnitude))
        high = magnitude >= mean[group].unsqueeze(1)
        levels = []
        for side in (~high, high):  # lo, then hi
            n = group_sum(side)
            levels.append(torch.where(n > 0, group_sum(magnitude * side) / n.clamp(min=1), mean))
        g0 = r0 // INT2_GROUP
        view["scales"][g0:g0 + count] = torch.stack(levels, dim=1)
        view["index"][r0:r1] = (idx | (picked < 0).long() << 6 | high.long() << 7).to(torch.uint8)

    @torch.no_grad()
    def encode(self, error: torch.Tensor, payload: torch.Tensor) -> None:
        """Pick and round the top ``topk`` of each chunk of ``error`` (fp32, :attr:`padded`
        elements, holding u) into ``payload``, and leave in ``error`` what was not sent:
        ``u − scatter(index, dequantized values)``, bit for bit."""
        view = self.views(payload)
        rows = error.view(self.chunks, self.chunk)
        for r0, r1 in self.row_blocks():
            self.encode_rows(rows[r0:r1], view, r0, r1)

    @torch.no_grad()
    def encode_rows(self, u: torch.Tensor, view: dict, r0: int, r1: int) -> None:
        """:meth:`encode` of chunk rows ``r0:r1`` (a block of :meth:`row_blocks`): ``u``
        (``[r1 − r0, chunk]`` fp32) into the payload ``view``, what was not sent left in ``u``."""
        magnitude = temporary(u.numel(), torch.float32, u.device).view_as(u)
        torch.abs(u, out=magnitude)
        idx = magnitude.topk(self.topk, dim=1, sorted=False).indices
        picked = u.gather(1, idx)
        if self.values == "int2":  # (its indices share their bytes with the values)
            self.encode_int2(view, r0, r1, idx, picked)
        else:
            if self.values == "bf16":
                view["values"][r0:r1] = picked.to(torch.bfloat16)
            else:
                scale = picked.abs().amax(dim=1)
                view["scales"][r0:r1] = scale
                safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
                view["values"][r0:r1] = (picked / safe * INT8_LEVELS).round_().clamp_(
                    -INT8_LEVELS, INT8_LEVELS).to(torch.int8)
            view["index"][r0:r1] = idx.to(self.index_dtype)
        u.scatter_(1, idx, picked - self.dequantize(view, r0, r1))

    @torch.no_grad()
    def mean_into(self, payloads: List[torch.Tensor], r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``r0:r1`` of the mean over ``payloads`` (every replica's, in replica order) of
        their dense values, written into ``out`` (``[r1 − r0, chunk]`` fp32): summed in payload
        order, then divided by their number, so every replica computes the same bits."""
        out.zero_()
        for payload in payloads:
            view = self.views(payload)
            out.scatter_add_(1, self.indices(view, r0, r1), self.dequantize(view, r0, r1))
        return out.div_(len(payloads))
