"""Reduced-rank regression (RRR): the closed-form low-rank linear code of SCD's REUSE step.

Given paired rows X (N, d_in) from the producer and Y (N, d_out) from the consumer, fit
``Y ≈ (X - μ_x) E D + μ_y`` with encoder E (d_in, r) and decoder D (r, d_out): ridge
least squares B = (XcᵀXc + λ I)⁻¹ XcᵀYc, then project onto the top-r right singular
vectors V_r of the fitted values Ŷ = Xc B, so E = B V_r and D = V_rᵀ. Every rank up to
the maximum shares one fit: rank r uses the first r columns of E / rows of D.

Shrinkage toward identity (d_in = d_out): B = I + Δ with a ridge α on the correction Δ,
i.e. B = (XcᵀXc + (λ+α) I)⁻¹ (XcᵀYc + α I). α = 0 is plain ridge regression; α → ∞ gives
B = I, whose rank-r code is the PCA of the producer rows (the "identity code": raw reuse
at full rank, plus the mean shift). ``RRRStats`` are sums, so statistics of several
domains add up, and ``heldout_error`` scores a fitted map on another domain's statistics
in closed form: the leave-one-domain-out choice of α costs no extra forward pass.
``block`` takes the statistics of a part of the
rows (keys alone out of keys and values), ``residual_of`` those of a first map's output and
its residual, so a joint refinement of both (scdviz.scd.calibrate) is fitted and scored from
the same sums. Directions are ordered by how much each lowers the fit error (by singular value when
unshrunk); a shrunk map's last directions can raise the error on the fit rows, which is
the price of its lower error on other domains.

Pure tensor maths, fp64 inside; no models, no I/O. Statistics live on the host unless made on
another device (calibrate keeps them, and the linear algebra on them, on the consumer's GPU);
codes come out where their statistics are (``LinearCode.to``). Rank allocation to a byte budget
is ``allocate_ranks``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
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

    def rescaled(self, sigma: Tensor) -> LinearCode:
        """A code fitted on rows divided by ``sigma`` (``RRRStats.scaled``) as a code of the rows themselves:
        the same codes, encoder and decoder absorbing the scale (its decoder rows are then no longer
        orthonormal; spectrum and fit errors stay those of the scaled rows)."""
        s = sigma.float()
        return LinearCode(self.mu_in * s, self.mu_out * s, self.enc / s[:, None], self.dec * s[None, :], self.spectrum,
                          self.fit_err)

    def to(self, device: torch.device | str) -> LinearCode:
        """The same code with its tensors on ``device`` (a calibration file holds host codes)."""
        return LinearCode(*(t.to(device) for t in (self.mu_in, self.mu_out, self.enc, self.dec, self.spectrum,
                                                   self.fit_err)))

    def truncated(self, rank: int) -> LinearCode:
        """The same code keeping only ranks ≤ ``rank`` (smaller to store)."""
        return LinearCode(self.mu_in, self.mu_out, self.enc[:, :rank], self.dec[:rank], self.spectrum[:rank],
                          self.fit_err[: rank + 1])


class RRRStats:
    """Sufficient statistics (sums and cross-products, fp64) of paired rows, added in batches.

    Lets calibration fit every layer without holding all rows in memory. ``device``: where the sums, and
    everything computed from them, live (default the host, where host-side codes are fitted, see scd.transfer).
    """

    def __init__(self, d_in: int, d_out: int, device: torch.device | str | None = None):
        self.n = 0
        where = dict(dtype=torch.float64, device=torch.device("cpu") if device is None else torch.device(device))
        self.sx = torch.zeros(d_in, **where)
        self.sy = torch.zeros(d_out, **where)
        self.sxx = torch.zeros(d_in, d_in, **where)
        self.sxy = torch.zeros(d_in, d_out, **where)
        self.syy = torch.zeros(d_out, **where)  # per output dimension, so blocks of the output can be taken

    @property
    def device(self) -> torch.device:
        """Where these statistics live."""
        return self.sxx.device

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add rows x (N, d_in), y (N, d_out) (from any device)."""
        x, y = x.to(self.device).double(), y.to(self.device).double()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y
        self.syy += (y**2).sum(0)

    def __add__(self, other: RRRStats) -> RRRStats:
        out = RRRStats(0, 0, self.device)
        out.n = self.n + other.n
        for name in ("sx", "sy", "sxx", "sxy", "syy"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def block(self, rows: slice, cols: slice) -> RRRStats:
        """The statistics of input dimensions ``rows`` and output dimensions ``cols`` only (exact)."""
        out = RRRStats(0, 0, self.device)
        out.n, out.sx, out.sy, out.syy = self.n, self.sx[rows], self.sy[cols], self.syy[cols]
        out.sxx, out.sxy = self.sxx[rows, rows], self.sxy[rows, cols]
        return out

    def scaled(self, sigma: Tensor) -> RRRStats:
        """The statistics of the pairs (x / sigma, y / sigma), sigma (d,) per column, in closed form (exact;
        d_in = d_out). Fitting there weighs every column alike, as the scale-free ridge and shrinkage assume:
        a stream with a few huge columns (a residual's massive activations) would otherwise have them set
        the scale and shrink every other direction to nothing. ``LinearCode.rescaled`` maps the code back."""
        inv = 1 / sigma.double()
        out = RRRStats(0, 0, self.device)
        out.n, out.sx, out.sy, out.syy = self.n, self.sx * inv, self.sy * inv, self.syy * inv**2
        out.sxx, out.sxy = self.sxx * torch.outer(inv, inv), self.sxy * torch.outer(inv, inv)
        return out

    def residual_of(self, mu_x: Tensor, b: Tensor | Sequence[Tensor], mu_y: Tensor) -> RRRStats:
        """Statistics of the pairs (ŷ, y − ŷ) with ŷ = (x − μ_x) B + μ_y, in closed form (exact).

        What a second map fitted on a first map's output and its residual needs (d_in = d_out). ``b``: B, or
        the square diagonal blocks of a block-diagonal B (separate key and value maps): the same sums from
        half the d³ products.
        """
        n = self.n
        blocks = [b] if isinstance(b, Tensor) else list(b)
        cuts = [0, *itertools.accumulate(m.shape[0] for m in blocks)]
        parts = [slice(lo, hi) for lo, hi in zip(cuts, cuts[1:])]
        a = self.sx - n * mu_x  # Σ (x − μ_x)
        aa = self.sxx - torch.outer(self.sx, mu_x) - torch.outer(mu_x, self.sx) + n * torch.outer(mu_x, mu_x)
        ab = torch.cat([a[h] @ m for h, m in zip(parts, blocks)])  # Bᵀ a
        aab = torch.cat([aa[:, h] @ m for h, m in zip(parts, blocks)], 1)  # (X − μ_x)ᵀ(X − μ_x) B
        s_hat = ab + n * mu_y
        hh = (torch.cat([m.T @ aab[h] for h, m in zip(parts, blocks)]) + torch.outer(ab, mu_y) + torch.outer(mu_y, ab)
              + n * torch.outer(mu_y, mu_y))
        pxy = self.sxy - torch.outer(mu_x, self.sy)
        hy = torch.cat([m.T @ pxy[h] for h, m in zip(parts, blocks)]) + torch.outer(mu_y, self.sy)
        out = RRRStats(0, 0, self.device)
        out.n, out.sx, out.sxx = n, s_hat, hh
        out.sy, out.sxy = self.sy - s_hat, hy - hh
        out.syy = self.syy - 2 * hy.diagonal() + hh.diagonal()
        return out

    def total(self) -> Tensor:
        """‖Yc‖², the centred output energy of these rows (the denominator of every relative error)."""
        n = max(self.n, 1)
        return (self.syy.sum() - n * ((self.sy / n) ** 2).sum()).clamp_min(1e-30)

    def centred(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(μ_x, μ_y, XcᵀXc, XcᵀYc, ‖Yc‖²) of these rows."""
        n = max(self.n, 1)
        mu_x, mu_y = self.sx / n, self.sy / n
        gram = self.sxx - n * torch.outer(mu_x, mu_x)
        cross = self.sxy - n * torch.outer(mu_x, mu_y)
        return mu_x, mu_y, gram, cross, self.total()

    def about(self, mu_x: Tensor) -> Tensor:
        """Σ (x − μ_x)(x − μ_x)ᵀ over these rows, about a mean fitted elsewhere."""
        n = self.n
        return self.sxx - torch.outer(self.sx, mu_x) - torch.outer(mu_x, self.sx) + n * torch.outer(mu_x, mu_x)

    def full_map(self, ridge: float = 1e-3, shrink: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """(μ_x, μ_y, B): the full-rank map, ridge λ and identity shrinkage α both relative to
        the mean eigenvalue of XcᵀXc; ``shrink=inf`` gives B = I."""
        mu_x, mu_y, gram, cross, _ = self.centred()
        return mu_x, mu_y, _solved(gram, cross, ridge, shrink)[0]

    def heldout_error(self, mu_x: Tensor, mu_y: Tensor, b: Tensor) -> float:
        """Σ‖y − μ_y − (x − μ_x) B‖² / Σ‖y − ȳ‖² over THESE rows, for a map fitted elsewhere."""
        n = self.n
        yy = self.syy.sum() - 2 * mu_y @ self.sy + n * mu_y @ mu_y
        xy = self.sxy - torch.outer(self.sx, mu_y) - torch.outer(mu_x, self.sy) + n * torch.outer(mu_x, mu_y)
        err = yy - 2 * (b * xy).sum() + (b * (self.about(mu_x) @ b)).sum()
        return float(err / self.total())

    def fit(self, ridge: float = 1e-3, max_rank: int | None = None, shrink: float = 0.0,
            lean: bool = False) -> LinearCode:
        """The LinearCode of these rows (see ``fit_rrr``); ``shrink``: α toward identity.

        ``lean`` (no shrinkage): the same code from two d³ products fewer. The map solves (XcᵀXc + μI) B =
        XcᵀYc, so ŶᵀŶ = Bᵀ(XcᵀYc − μB) and s_i c_i = vᵢᵀBᵀXcᵀYc vᵢ = s_i² + μ‖B vᵢ‖². Equal to rounding, so
        directions whose gains tie to rounding may come in another order: for codes kept at their leading ranks
        (the joint refinement); the REUSE codes keep every rank and the default arithmetic.
        """
        if lean and shrink:
            raise ValueError("a lean fit has no shrinkage toward identity")
        mu_x, mu_y, gram, cross, total = self.centred()
        b, mu = _solved(gram, cross, ridge, shrink)
        if lean:
            evals, evecs = torch.linalg.eigh(b.T @ (cross - mu * b))  # ŶᵀŶ = V S² Vᵀ
            s_all = evals.clamp_min(0).sqrt()
            bv = b @ evecs
            dots = evals + mu * (bv**2).sum(0)  # s_i c_i
        else:
            evals, evecs = torch.linalg.eigh(b.T @ gram @ b)  # ŶᵀŶ = V S² Vᵀ
            s_all = evals.clamp_min(0).sqrt()
            bv = b @ evecs
            dots = (bv * (cross @ evecs)).sum(0)
        c_all = dots / s_all.clamp_min(1e-30)  # u_iᵀ Yc v_i
        gain = 2 * s_all * c_all - s_all**2  # drop of the fit error when direction i is added
        order = gain.argsort(descending=True)  # = by singular value when unshrunk (c_i ≈ s_i)
        r = min(max_rank or order.numel(), order.numel())
        s, v = s_all[order[:r]], evecs[:, order[:r]]  # (r,), (d_out, r)
        gains = torch.cumsum(gain[order[:r]], 0)
        fit_err = torch.cat([torch.ones(1, dtype=s.dtype, device=s.device), 1 - gains / total])
        enc = bv[:, order[:r]] if lean else b @ v
        return LinearCode(mu_x.float(), mu_y.float(), enc.float(), v.T.float(), s.float(), fit_err.float())


def _solved(gram: Tensor, cross: Tensor, ridge: float, shrink: float) -> tuple[Tensor, float | Tensor]:
    """(B, μ): ``RRRStats.full_map``'s map from centred statistics and the absolute ridge it solved with,
    (XcᵀXc + μI) B = XcᵀYc (+ the shrinkage's αI, α relative as λ is); μ = 0 for B = I."""
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    if shrink == float("inf"):
        if cross.shape[0] != cross.shape[1]:
            raise ValueError("shrinkage toward identity needs d_in == d_out")
        return eye, 0.0
    scale = gram.diagonal().mean().clamp_min(1e-12)
    target = cross + shrink * scale * eye if shrink else cross
    mu = (ridge + shrink) * scale
    return torch.linalg.solve(gram + mu * eye, target), mu


def fit_rrr(x: Tensor, y: Tensor, ridge: float = 1e-3, max_rank: int | None = None, shrink: float = 0.0) -> LinearCode:
    """Fit a LinearCode on rows x (N, d_in), y (N, d_out).

    ridge: λ relative to the mean eigenvalue of XcᵀXc (scale-free).
    fit_err[r] = ‖Yc − Ŷ_r‖² / ‖Yc‖², from the SVD Ŷ = U S Vᵀ and c_i = u_iᵀ Yc v_i:
    ‖Yc‖² − Σ_{i≤r} (2 s_i c_i − s_i²). With λ = 0, c_i = s_i and the error is
    non-increasing in r; a small ridge keeps c_i ≥ s_i / 2, so it stays non-increasing.
    """
    stats = RRRStats(x.shape[1], y.shape[1])
    stats.add(x, y)
    return stats.fit(ridge, max_rank, shrink)


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
