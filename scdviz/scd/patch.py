"""PATCH: a code of the producer's normalised H_in and a linear aligner to the consumer's.

At a patch layer the producer sends a code of its H_in (the output of input_layernorm)
instead of K/V; the consumer maps it to an estimate of its *own* H_in and regenerates
K, V with its own k_proj / v_proj (+ RoPE). Normalisation: every dimension is
standardised (mean, std from calibration), so the few huge activation dimensions do not
dominate the PCA basis or the quantisation ranges. ``rank_h = d`` sends the whole
normalised H_in (no PCA).

The aligner works in normalised space: identity + a linear correction, ``ĥ_C = ĥ_P + ĥ_P Δ + b``,
fitted in closed form with a ridge α on Δ (shrinkage toward the identity aligner, i.e. toward "the
consumer regenerates K, V from the producer's own H_in"), on the error of the K, V the
consumer's own projections make from it (``kv_weight`` given) or on the normalised H
error. (A residual MLP on top, the seed's, left in the one-recipe cleanup: docs/history.md.)
Pure tensors + torch.nn; the model weights come in as tensors (scdviz.models.hf.kv_weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


class Aligner(nn.Module):
    """Identity + a linear correction on normalised H_in, (N, d) -> (N, d); starts at identity."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        nn.init.zeros_(self.lin.weight)
        nn.init.zeros_(self.lin.bias)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.lin(h)


def linear_corrections(zp: Tensor, zc: Tensor, proj: Tensor | None, shrinks: list[float],
                       ridge: float = 1e-3) -> list[tuple[Tensor, Tensor]]:
    """Per shrinkage α: (Δ (d, d), b (d,)) minimising ‖(zp + zp Δ + b − zc) P‖² + (λ+α)·s·‖Δ‖², closed form.

    P = proj (d, d_out), or the identity when None. With Q = P Pᵀ = U diag(l) Uᵀ and
    XᵀX = V diag(g) Vᵀ (X: centred zp), the normal equations XᵀX Δ Q + c Δ = XᵀR Q are
    diagonal in those bases: Δ = V [(Vᵀ XᵀR U) l ⊘ (g lᵀ + c)] Uᵀ, R = zc − zp centred,
    so every α shares one pair of eigendecompositions. λ (ridge) and α are relative to
    s = mean(g) · mean(l); α = inf gives Δ = 0 (the identity aligner). Directions P
    ignores get no correction (the minimum-norm solution).
    """
    mu_p, resid = zp.mean(0), zc - zp
    mu_r = resid.mean(0)
    x = zp - mu_p
    g, v = torch.linalg.eigh((x.T @ x).double())
    q = (proj @ proj.T).double() if proj is not None else torch.eye(zp.shape[1], dtype=torch.float64, device=zp.device)
    lq, u = torch.linalg.eigh(q)
    g, lq = g.clamp_min(0), lq.clamp_min(0)
    scale = g.mean().clamp_min(1e-12) * lq.mean().clamp_min(1e-12)
    rotated = (v.T @ (x.T @ (resid - mu_r)).double() @ u) * lq[None, :]
    out = []
    for alpha in shrinks:
        if alpha == float("inf"):
            out.append((torch.zeros_like(q).float(), mu_r))
            continue
        delta = (v @ (rotated / (g[:, None] * lq[None, :] + (ridge + alpha) * scale)) @ u.T).float()
        out.append((delta, mu_r - mu_p @ delta))
    return out


@dataclass
class Patch:
    """Everything a patch layer needs on both sides."""

    layer: int  # decoder layer
    in_mean: Tensor  # (d,) producer H_in mean
    in_std: Tensor  # (d,) producer H_in std per dimension
    out_mean: Tensor  # (d,) consumer H_in mean
    out_std: Tensor  # (d,) consumer H_in std per dimension
    basis: Tensor | None  # (d, rank_h) PCA basis of normalised producer H_in; None = send all d
    aligner: Aligner  # normalised producer -> normalised consumer H_in
    fit_err: float  # relative K/V error of the regenerated layer on calibration rows

    @property
    def rank_h(self) -> int:
        """Width of the transmitted code."""
        return self.in_mean.numel() if self.basis is None else int(self.basis.shape[1])

    def encode(self, h: Tensor) -> Tensor:
        """Producer H_in (N, d) -> code (N, rank_h)."""
        z = (h.float() - self.in_mean) / self.in_std
        return z if self.basis is None else z @ self.basis

    def decode(self, z: Tensor) -> Tensor:
        """Code (N, rank_h) -> estimate of the consumer's H_in (N, d)."""
        h = z.float() if self.basis is None else z.float() @ self.basis.T
        with torch.no_grad():
            return self.aligner(h) * self.out_std + self.out_mean


def fit_patches(layer: int, h_p: Tensor, h_c: Tensor, kv_weight: Tensor | None = None, rank_h: int | None = None,
                shrinks: list[float] = (0.1,), ridge: float = 1e-3) -> list[Patch]:
    """Patches on paired rows h_p, h_c (N, d), one per shrinkage, sharing one fit.

    kv_weight: (d_out, d) stacked consumer k_proj/v_proj weights; when given the loss is
    the error of the K, V regenerated from the aligned H_in (else the normalised H error).
    """
    h_p, h_c = h_p.float(), h_c.float()
    in_mean, in_std = h_p.mean(0), h_p.std(0).clamp_min(1e-6)
    out_mean, out_std = h_c.mean(0), h_c.std(0).clamp_min(1e-6)
    zp, zc = (h_p - in_mean) / in_std, (h_c - out_mean) / out_std
    basis = None
    if rank_h is not None and rank_h < h_p.shape[1]:
        basis = torch.linalg.svd(zp, full_matrices=False)[2][:rank_h].T.contiguous()  # (d, rank_h)
        zp = zp @ basis @ basis.T
    proj = _projection(out_std, kv_weight)
    out = []
    for delta, bias in linear_corrections(zp, zc, proj, list(shrinks), ridge):
        aligner = Aligner(h_p.shape[1])
        with torch.no_grad():
            aligner.lin.weight.copy_(delta.T)
            aligner.lin.bias.copy_(bias)
        patch = Patch(layer, in_mean, in_std, out_mean, out_std, basis, aligner.eval(), fit_err=0.0)
        patch.fit_err = _kv_error(patch, h_p, h_c, kv_weight)
        out.append(patch)
    return out


def fit_patch(layer: int, h_p: Tensor, h_c: Tensor, kv_weight: Tensor | None = None, rank_h: int | None = None,
              shrink: float = 0.1, ridge: float = 1e-3) -> Patch:
    """The Patch of one shrinkage (``fit_patches``)."""
    return fit_patches(layer, h_p, h_c, kv_weight, rank_h, [shrink], ridge)[0]


def _projection(out_std: Tensor, kv_weight: Tensor | None) -> Tensor | None:
    """(d, d_out): normalised consumer H_in -> its K, V (without the mean); None for the H loss."""
    return (out_std[:, None] * kv_weight.float().T) if kv_weight is not None else None


def _kv_error(patch: Patch, h_p: Tensor, h_c: Tensor, kv_weight: Tensor | None) -> float:
    """Relative squared error of the aligned H_in (through kv_weight when given)."""
    est = patch.decode(patch.encode(h_p))
    w = kv_weight.float().T if kv_weight is not None else torch.eye(h_c.shape[1], device=h_c.device)
    ref = h_c @ w
    return float(((est @ w - ref) ** 2).sum() / ((ref - ref.mean(0)) ** 2).sum())
