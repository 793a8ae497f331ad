"""Muon on one rank's fp32 shard: the hidden weight matrices orthogonalised, everything else AdamW.

Muon (Jordan et al. 2024; as scaled in Moonlight, arXiv 2502.16982): for each hidden matrix W with
gradient G, momentum M ← β·M + (1 − β)·G, Nesterov U = (1 − β)·G + β·M, and

    W ← W·(1 − lr·wd) − lr · 0.2·√max(A, B) · NS₅(U)

where NS₅ is five Newton–Schulz iterations towards U's orthogonal factor and 0.2·√max(A, B) gives
the update the RMS of an AdamW update, so the param group's own ``lr`` and ``weight_decay`` drive it
(no second learning rate). Embeddings (an ``nn.Embedding``'s weight, and a Hugging Face model's
output head), vectors and scalars keep AdamW (:class:`~ds_lowcomm.shard.adamw.ShardAdamW`'s
kernel). The momentum lives in ``exp_avg``; a matrix's ``exp_avg_sq`` stays zero.

Newton–Schulz needs a whole matrix. M and U are elementwise, so each rank computes them on its own
shard; a matrix that a shard boundary cuts is made whole with one all-reduce over the shard group
(each rank's part in place, zeros elsewhere: 2(W−1)/W · 4 bytes per element of the matrix), and
every rank holding a part runs NS₅ on it and keeps its part of the result. At most W − 1 matrices
are cut (one per boundary, fewer where a matrix spans several), so a step sends at most the W − 1
largest matrices, whatever the model's size; the others need nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ds_lowcomm.memory import temporary
from ds_lowcomm.shard.adamw import ShardAdamW
from ds_lowcomm.shard.flat import FlatParams

MUON_MOMENTUM = 0.95
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: fast growth of small singular values
NS_STEPS = 5
RMS_MATCH = 0.2  # Moonlight's factor: an AdamW update's RMS is about 0.2 (their section 2.2)
#: at most this many elements in one batch of same-shape matrices (128 MiB of fp32 U): a constant
#: bound on the batch's stacked temporaries, not the model's size. A matrix larger than this is a
#: batch of its own, so from about 7B parameters up (4096 × 11008 matrices) a step's temporaries
#: are the largest matrix's, as one matrix at a time; below, up to this bound buys fewer launches
NS_BATCH_ELEMENTS = 1 << 25


def newton_schulz(u: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """About the orthogonal factor of ``u``, a matrix or a batch of matrices of one shape
    (``n × rows × cols``, each orthogonalised on its own), contiguous: singular values pushed into
    about [0.7, 1.2]. Local: no communication. In bf16 on CUDA, as Muon's authors run it (the
    iteration tolerates it, and its matmuls are most of the step's cost); in fp32 elsewhere. Each
    iteration is two fused ``baddbmm`` and one matmul, X ← aX + (bA + cA²)X with A = XXᵀ, on the
    wide orientation."""
    a, b, c = NS_COEFFS
    x = u.to(torch.bfloat16 if u.is_cuda else torch.float32)
    one = x.dim() == 2
    if one:
        x = x.unsqueeze(0)
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    for _ in range(steps):
        g = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(g, g, g, beta=b, alpha=c), x, beta=a)
    x = x.mT if tall else x
    return (x[0] if one else x).contiguous()


@dataclass(frozen=True)
class Matrix:
    """A hidden matrix in the flat buffer: elements ``[start, end)``, ``rows × cols``, of param
    group ``group``; ``cut``: a shard boundary falls inside it."""
    start: int
    rows: int
    cols: int
    group: int
    cut: bool

    @property
    def end(self) -> int:
        """One past the matrix's last element in the flat buffer."""
        return self.start + self.rows * self.cols


def muon_matrices(flat: FlatParams, modules: Sequence[torch.nn.Module]) -> List[Matrix]:
    """Every hidden matrix of the model, in flat order (the same list on every rank): 2-D, not an
    ``nn.Embedding``'s weight nor the output head a Hugging Face model names
    (``get_output_embeddings``); ``modules`` is the model's, root first. Raises ValueError when
    there are no modules (the embeddings would be unknown)."""
    if not modules:
        raise ValueError("Muon needs the model's modules to leave its embeddings to AdamW; build the "
                         "optimizer through deepspeed.initialize(model=...)")
    embeddings = {id(m.weight) for m in modules if isinstance(m, torch.nn.Embedding)}
    head = getattr(modules[0], "get_output_embeddings", lambda: None)()
    if head is not None:
        embeddings.add(id(head.weight))
    layout = flat.layout
    out = []
    for p in flat.params:
        if p.dim() != 2 or id(p) in embeddings or p.numel() == 0:
            continue
        start = flat.offsets[id(p)]
        end = start + p.numel()
        group = next(g for g, (s, e) in enumerate(layout.group_ranges) if s <= start < e)
        cut = start // layout.shard_size != (end - 1) // layout.shard_size
        out.append(Matrix(start, p.shape[0], p.shape[1], group, cut))
    return out


class ShardMuon(ShardAdamW):
    """:class:`ShardAdamW`'s state and interface; ``matrices`` (:func:`muon_matrices`) get Muon's
    update, the rest of the shard AdamW's. ``comm``: the shard group's collectives, which make
    the cut matrices whole."""

    def __init__(self, layout, initial_params: torch.Tensor, matrices: Sequence[Matrix], comm) -> None:
        super().__init__(layout, initial_params)
        self.comm = comm
        lo, hi = layout.shard_start, layout.shard_start + layout.shard_size
        #: the matrices this step touches: those overlapping the shard, and every cut one (its
        #: all-reduce is collective)
        self.matrices = [m for m in matrices if m.cut or (lo <= m.start and m.end <= hi)]
        self.adamw_segments = self._complement(lo, hi)
        #: the whole matrices of the shard, by shape, in batches of at most NS_BATCH_ELEMENTS
        self.batches = _batches([m for m in self.matrices if not m.cut])

    def _complement(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        """``(group, start, end)`` in shard coordinates: the shard's segments outside every matrix."""
        cuts = sorted((max(m.start, lo) - lo, min(m.end, hi) - lo) for m in self.matrices
                      if m.start < hi and m.end > lo)
        out = []
        for seg in self.segments:
            a = seg.start
            for s, e in cuts:
                if e <= a or s >= seg.end:
                    continue
                if s > a:
                    out.append((seg.group, a, s))
                a = max(a, e)
            if a < seg.end:
                out.append((seg.group, a, seg.end))
        return out

    def step(self, grad: torch.Tensor, param_groups: Sequence[dict], factor: float = 1.0) -> None:
        """One update in place from the shard gradient ``factor · grad`` (fp32, ``factor`` 1; or
        2-byte sums, converted a chunk or a matrix at a time). The shard's whole matrices go
        through Newton–Schulz a batch of one shape at a time (one launch per op of the iteration
        for the batch: on a GPU, launching it per matrix costs more than its matmuls at GPT-2's
        sizes); the momentum and the update stay per matrix.
        Collective over the shard group where a matrix is cut (module doc for the bytes)."""
        self.step_segments(grad, param_groups, factor, self.adamw_segments)
        lo, device = self.layout.shard_start, self.master.device
        for m in self.matrices:
            if not m.cut:
                continue
            a, b = self._in_shard(m)
            whole = temporary(m.end - m.start, torch.float32, device).zero_()
            if a < b:
                self._nesterov(grad, factor, a, b, out=whole[a + lo - m.start: b + lo - m.start])
            self.comm.all_reduce(whole)
            if a < b:
                u = newton_schulz(whole.view(m.rows, m.cols)).view(-1)[a + lo - m.start: b + lo - m.start]
                self._apply(m, a, b, u, param_groups)
        for batch in self.batches:
            self._step_batch(batch, grad, factor, param_groups)
        self.advance(None)

    def _step_batch(self, batch: Sequence[Matrix], grad: torch.Tensor, factor: float,
                    param_groups: Sequence[dict]) -> None:
        """Muon's update of ``batch``, whole matrices of one shape in the shard: their U stacked,
        one batched Newton–Schulz (its temporaries freed on return, before the next batch's)."""
        lo, (rows, cols) = self.layout.shard_start, (batch[0].rows, batch[0].cols)
        u = temporary(len(batch) * rows * cols, torch.float32, self.master.device).view(len(batch), -1)
        for i, m in enumerate(batch):
            self._nesterov(grad, factor, m.start - lo, m.end - lo, out=u[i])
        for m, o in zip(batch, newton_schulz(u.view(len(batch), rows, cols))):
            self._apply(m, m.start - lo, m.end - lo, o.view(-1), param_groups)

    def _apply(self, m: Matrix, a: int, b: int, u: torch.Tensor, param_groups: Sequence[dict]) -> None:
        """θ ← θ·(1 − lr·wd) − lr · 0.2·√max(A, B) · U on shard elements ``[a, b)`` of matrix ``m``."""
        hp = param_groups[m.group]
        self.master[a:b].mul_(1 - hp["lr"] * hp["weight_decay"]).add_(
            u, alpha=-hp["lr"] * RMS_MATCH * math.sqrt(max(m.rows, m.cols)))

    def informative_ranges(self, key: str) -> Optional[List[Tuple[int, int]]]:
        """The matrices have no second moment (their ``exp_avg_sq`` stays zero): only the AdamW
        ranges of it carry anything."""
        return [(a, b) for _, a, b in self.adamw_segments] if key == "exp_avg_sq" else None

    def decay(self, key: str, values: torch.Tensor, updates: int, param_groups: Sequence[dict]) -> None:
        """AdamW's on its ranges; on the matrices Muon's momentum decays by ``MUON_MOMENTUM``^n
        (their ``exp_avg_sq`` stays zero: left as it is)."""
        super().decay(key, values, updates, param_groups)
        if key != "exp_avg":
            return
        for m in self.matrices:
            a, b = self._in_shard(m)
            if a < b:
                values[a:b].mul_(MUON_MOMENTUM ** updates)

    def _in_shard(self, m: Matrix) -> Tuple[int, int]:
        """``[a, b)``: the part of matrix ``m`` in this shard, in shard coordinates (empty: a ≥ b)."""
        lo = self.layout.shard_start
        return max(m.start - lo, 0), min(m.end - lo, self.layout.shard_size)

    def _nesterov(self, grad: torch.Tensor, factor: float, a: int, b: int, out: torch.Tensor) -> None:
        """M ← β·M + (1 − β)·G on shard elements ``[a, b)``; writes U = (1 − β)·G + β·M into
        ``out`` (fp32, ``b − a`` elements)."""
        g = out.copy_(grad[a:b]).mul_(factor)
        self.exp_avg[a:b].lerp_(g, 1 - MUON_MOMENTUM)
        g.lerp_(self.exp_avg[a:b], MUON_MOMENTUM)

    def estimate(self, *args, **kwargs) -> None:
        """Refused: acco's estimate step is AdamW's, and Muon runs only as desloc's local step."""
        raise NotImplementedError("ACCO's estimate is AdamW's; Muon is desloc's inner step only")


def _batches(matrices: Sequence[Matrix]) -> List[List[Matrix]]:
    """``matrices`` grouped by shape (in order of first appearance), each group cut into batches
    of at most ``NS_BATCH_ELEMENTS`` elements (at least one matrix each)."""
    by_shape = {}
    for m in matrices:
        by_shape.setdefault((m.rows, m.cols), []).append(m)
    out = []
    for (rows, cols), group in by_shape.items():
        per = max(1, NS_BATCH_ELEMENTS // (rows * cols))
        out += [group[i:i + per] for i in range(0, len(group), per)]
    return out
