"""Reduced-rank regression (RRR): the closed-form low-rank linear code of SCD's REUSE step.

Given paired rows X (N, d_in) from the producer and Y (N, d_out) from the consumer, fit
``Y ≈ (X - μ_x) E D + μ_y`` with encoder E (d_in, r) and decoder D (r, d_out): ridge
least squares B = (XcᵀXc + λ I)⁻¹ XcᵀYc, then project onto the top-r right singular
vectors V_r of the fitted values Ŷ = Xc B, so E = B V_r and D = V_rᵀ. Every rank up to
the maximum shares one fit: rank r uses the first r columns of E / rows of D.

Pure tensor maths, fp64 inside; no models, no I/O. Rank allocation to a byte budget is
``allocate_ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LinearCode:
    """A fitted rank-≤r_max linear map from producer rows to consumer rows."""

    mu_in: Tensor  # (d_in,) producer mean
    mu_out: Tensor  # (d_out,) consumer mean
    enc: Tensor  # (d_in, r_max) encoder E, columns ordered by singular value
    dec: Tensor  # (r_max, d_out) decoder D (orthonormal rows)
    spectrum: Tensor  # (r_max,) singular values of the fitted values (the rank spectrum)
    fit_err: Tensor  # (r_max + 1,) relative squared error on the fit data at rank 0..r_max

    @property
    def max_rank(self) -> int:
        """Largest rank this code can be used at."""
        return int(self.enc.shape[1])

    def encode(self, x: Tensor, rank: int) -> Tensor:
        """Producer rows (N, d_in) -> codes (N, rank)."""
        return (x.float() - self.mu_in) @ self.enc[:, :rank]

    def decode(self, z: Tensor) -> Tensor:
        """Codes (N, rank) -> consumer rows (N, d_out)."""
        return z.float() @ self.dec[: z.shape[1]] + self.mu_out

    def truncated(self, rank: int) -> LinearCode:
        """The same code keeping only ranks ≤ ``rank`` (smaller to store)."""
        return LinearCode(self.mu_in, self.mu_out, self.enc[:, :rank], self.dec[:rank], self.spectrum[:rank], self.fit_err[: rank + 1])


class RRRStats:
    """Sufficient statistics (sums and cross-products, fp64) of paired rows, added in batches.

    Lets calibration fit every layer without holding all rows in memory.
    """

    def __init__(self, d_in: int, d_out: int):
        self.n = 0
        host = dict(dtype=torch.float64, device="cpu")  # statistics of host-side codes (see scd.transfer)
        self.sx = torch.zeros(d_in, **host)
        self.sy = torch.zeros(d_out, **host)
        self.sxx = torch.zeros(d_in, d_in, **host)
        self.sxy = torch.zeros(d_in, d_out, **host)
        self.syy = torch.zeros((), **host)

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add rows x (N, d_in), y (N, d_out)."""
        x, y = x.double(), y.double()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y
        self.syy += (y**2).sum()

    def fit(self, ridge: float = 1e-3, max_rank: int | None = None) -> LinearCode:
        """The LinearCode of these rows (see ``fit_rrr``)."""
        n = max(self.n, 1)
        mu_x, mu_y = self.sx / n, self.sy / n
        gram = self.sxx - n * torch.outer(mu_x, mu_x)  # Xcᵀ Xc
        cross = self.sxy - n * torch.outer(mu_x, mu_y)  # Xcᵀ Yc
        total = (self.syy - n * (mu_y**2).sum()).clamp_min(1e-30)  # ‖Yc‖²
        lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
        b = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device), cross)
        evals, evecs = torch.linalg.eigh(b.T @ gram @ b)  # ŶᵀŶ = V S² Vᵀ
        order = evals.argsort(descending=True)
        r = min(max_rank or order.numel(), order.numel())
        s = evals[order[:r]].clamp_min(0).sqrt()
        v = evecs[:, order[:r]]  # (d_out, r)
        c = ((b @ v) * (cross @ v)).sum(0) / s.clamp_min(1e-30)  # u_iᵀ Yc v_i
        gains = torch.cumsum(2 * s * c - s**2, 0)
        fit_err = torch.cat([torch.ones(1, dtype=s.dtype, device=s.device), 1 - gains / total])
        return LinearCode(mu_x.float(), mu_y.float(), (b @ v).float(), v.T.float(), s.float(), fit_err.float())


def fit_rrr(x: Tensor, y: Tensor, ridge: float = 1e-3, max_rank: int | None = None) -> LinearCode:
    """Fit a LinearCode on rows x (N, d_in), y (N, d_out).

    ridge: λ relative to the mean eigenvalue of XcᵀXc (scale-free).
    fit_err[r] = ‖Yc − Ŷ_r‖² / ‖Yc‖², from the SVD Ŷ = U S Vᵀ and c_i = u_iᵀ Yc v_i:
    ‖Yc‖² − Σ_{i≤r} (2 s_i c_i − s_i²). With λ = 0, c_i = s_i and the error is
    non-increasing in r; a small ridge keeps c_i ≥ s_i / 2, so it stays non-increasing.
    """
    stats = RRRStats(x.shape[1], y.shape[1])
    stats.add(x, y)
    return stats.fit(ridge, max_rank)


def allocate_ranks(codes: list[LinearCode], total_rank: int, min_rank: int = 1) -> list[int]:
    """Ranks per code summing to ``total_rank`` that greedily minimise the summed relative error.

    Every code gets ``min_rank`` first; each further dimension goes to the code whose
    relative fit error drops most by it (fit_err is per code, so layers count equally).
    """
    ranks = [min(min_rank, c.max_rank) for c in codes]
    gains = []
    for idx, code in enumerate(codes):
        drops = code.fit_err[:-1] - code.fit_err[1:]  # (r_max,) gain of dimension r+1
        gains += [(float(drops[r]), idx) for r in range(ranks[idx], code.max_rank)]
    gains.sort(key=lambda g: -g[0])
    budget = max(0, total_rank - sum(ranks))
    for _, idx in gains[:budget]:
        ranks[idx] += 1
    return ranks
