"""Muon on one rank's fp32 shard: the hidden weight matrices orthogonalised, everything else AdamW.

Muon (Jordan et al. 2024; as scaled in Moonlight, arXiv 2502.16982): for each hidden matrix W with
gradient G, momentum M ← β·M + (1 − β)·G, Nesterov U = (1 − β)·G + β·M, and

    W ← W·(1 − lr·wd) − lr · 0.2·√max(A, B) · NS₅(U)

where NS₅ is five Newton–Schulz iterations towards U's orthogonal factor and 0.2·√max(A, B) gives
the update the RMS of an AdamW update, so the param group's own ``lr`` and ``weight_decay`` drive it
(no second learning rate). Embeddings (an ``nn.Embedding``'s weight, and a head tied to one),
vectors and scalars keep AdamW (:class:`~ds_lowcomm.shard.adamw.ShardAdamW`'s kernel). The
momentum lives in ``exp_avg``; a matrix's ``exp_avg_sq`` stays zero.

Newton–Schulz needs a whole matrix, so every matrix Muon steps must lie inside one shard.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch.optim.adam import adam as _adam_kernel

from ds_lowcomm.shard.adamw import ShardAdamW
from ds_lowcomm.shard.flat import FlatParams

MUON_MOMENTUM = 0.95
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: fast growth of small singular values
NS_STEPS = 5
RMS_MATCH = 0.2  # Moonlight's factor: an AdamW update's RMS is about 0.2 (their section 2.2)


def newton_schulz(u: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """About the orthogonal factor of ``u`` (2-D): singular values pushed into about [0.7, 1.2]."""
    a, b, c = NS_COEFFS
    x = u / (u.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    for _ in range(steps):
        g = x @ x.mT
        x = a * x + (b * g + c * (g @ g)) @ x
    return x.mT if tall else x


def muon_matrices(flat: FlatParams, modules: Sequence[torch.nn.Module]) -> List[Tuple[int, int, int, int]]:
    """``(start, rows, cols, group)`` in shard coordinates of each hidden matrix in this rank's
    shard: 2-D, not an ``nn.Embedding``'s weight nor the output head a Hugging Face model names
    (``get_output_embeddings``); ``modules`` is the model's, root first. Raises ValueError when
    there are no modules (embeddings unknown) or a matrix straddles a shard boundary."""
    if not modules:
        raise ValueError("Muon needs the model's modules to leave its embeddings to AdamW; build the "
                         "optimizer through deepspeed.initialize(model=...)")
    embeddings = {id(m.weight) for m in modules if isinstance(m, torch.nn.Embedding)}
    head = getattr(modules[0], "get_output_embeddings", lambda: None)()
    if head is not None:
        embeddings.add(id(head.weight))
    layout = flat.layout
    lo, hi = layout.shard_start, layout.shard_start + layout.shard_size
    out = []
    for p in flat.params:
        if p.dim() != 2 or id(p) in embeddings:
            continue
        start = flat.offsets[id(p)]
        end = start + p.numel()
        if end <= lo or start >= hi:
            continue
        if start < lo or end > hi:
            raise ValueError(f"a {tuple(p.shape)} matrix straddles a shard boundary: Muon needs whole matrices "
                             f"in one shard (shard_group_size 1)")
        group = next(g for g, (s, e) in enumerate(layout.group_ranges) if s <= start < e)
        out.append((start - lo, p.shape[0], p.shape[1], group))
    return out


class ShardMuon(ShardAdamW):
    """:class:`ShardAdamW`'s state and interface; ``matrices`` (from :func:`muon_matrices`) get
    Muon's update, the rest of the shard AdamW's."""

    def __init__(self, layout, initial_params: torch.Tensor, matrices) -> None:
        super().__init__(layout, initial_params)
        self.matrices = list(matrices)
        self.adam_ranges = self._complement()

    def _complement(self) -> List[Tuple[int, int, int]]:
        """``(group, start, end)``: the parts of the shard's segments outside every matrix."""
        cuts = sorted((s, s + r * c) for s, r, c, _ in self.matrices)
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

    def step(self, grad: torch.Tensor, param_groups: Sequence[dict], factor: float = 1.0, chunk: int = 0) -> None:
        """One update in place from the shard gradient ``factor · grad`` (any float dtype)."""
        step = self.step_count
        for group, a, b in self.adam_ranges:
            hp = param_groups[group]
            beta1, beta2 = hp["betas"]
            g = grad[a:b].to(torch.float32).mul_(factor) if (grad.dtype != torch.float32 or factor != 1.0) \
                else grad[a:b]
            _adam_kernel([self.master[a:b]], [g], [self.exp_avg[a:b]], [self.exp_avg_sq[a:b]], [],
                         [torch.full((), float(step), device=self.master.device)],
                         fused=self._fused, decoupled_weight_decay=True, amsgrad=False,
                         beta1=beta1, beta2=beta2, lr=hp["lr"], weight_decay=hp["weight_decay"],
                         eps=hp["eps"], maximize=False)
        for s, rows, cols, group in self.matrices:
            hp = param_groups[group]
            sl = slice(s, s + rows * cols)
            g = grad[sl].to(torch.float32).mul(factor).view(rows, cols)
            m = self.exp_avg[sl].view(rows, cols)
            m.lerp_(g, 1 - MUON_MOMENTUM)
            u = newton_schulz(g.lerp_(m, MUON_MOMENTUM))
            w = self.master[sl].view(rows, cols)
            w.mul_(1 - hp["lr"] * hp["weight_decay"]).add_(u, alpha=-hp["lr"] * RMS_MATCH * math.sqrt(max(rows, cols)))
        self.step_count = step + 1

    def estimate(self, *args, **kwargs) -> None:
        raise NotImplementedError("ACCO's estimate is AdamW's; Muon is desloc's inner step only")
