"""Heads judged by the numbers the model's own modules were built with (their attributes and constructor
arguments), not by surgeon's tables: a re-initialized projection cut into those heads."""

from __future__ import annotations

import torch


def head_problems(name: str, weight: torch.Tensor, heads: int, head_dim: int, *, drawn: bool = True) -> list[str]:
    """What is wrong with ``weight`` (out, in) as ``heads`` re-initialized heads of ``head_dim`` rows each: every
    head's rows orthonormal (kappa 1); ``drawn`` (query and key): heads 0 and 1 are independent draws, not one
    orthonormal block cut in two (which is what a reset with fewer, wider heads leaves in the rows)."""
    w = weight.detach().double()
    if w.shape[0] != heads * head_dim:
        return [f"{name}: {w.shape[0]} rows, not {heads} heads of {head_dim}"]
    blocks = w.reshape(heads, head_dim, -1)
    problems = []
    for h, block in enumerate(blocks):
        gram = block @ block.T
        if not torch.allclose(gram, torch.eye(head_dim, dtype=gram.dtype), atol=1e-4):
            problems.append(f"{name}: head {h} of {head_dim} rows is not semi-orthogonal")
            break
    if drawn and heads > 1:
        cross = (blocks[0] @ blocks[1].T).abs().max().item()
        if cross < 1e-6:
            problems.append(f"{name}: heads 0 and 1 are one orthonormal block (the heads were cut wider)")
    return problems


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    """The names of the tensors whose values differ."""
    return {n for n, t in before.items() if n in after and not torch.equal(t, after[n])}
