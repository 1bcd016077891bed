"""SCD calibration: fit REUSE codes and PATCH aligners on paired prefixes, choose patch layers.

``calibrate(cfg, pair)`` runs the same calibration windows through producer and consumer
and fits, per layer, reduced-rank codes for pre-RoPE keys and for values (token 0, the
attention sink, left out of every fit: the consumer recomputes it) and a low-rank joint
refinement of both, which the consumer adds to the decoded rows (keys and values are two
projections of one hidden state, so each carries some of what the other misses; kept per
layer only where it lowers the leave-one-domain-out error), measures raw-reuse
drift, ranks layers by the KL gain of an *ideal* patch (the consumer's own K, V at that
layer), fits aligners for the candidates and orders patch layers greedily on
continuation KL (or as given). ``save`` / ``load`` write and read the
artefact (one safetensors file, scdviz.artefact); ``load`` refuses one made for another pair.
The REUSE statistics, and the fp64 linear algebra of every fit and choice on them, stay on the
consumer's GPU when it has one (with room), else on the host; what is stored comes back to the host.

It does not evaluate on held-out text (scdviz.scd.measure).
"""

from __future__ import annotations

import functools
import operator
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from scdviz import metrics
from scdviz.models import hf
from scdviz.models.pair import Pair
from scdviz.progress import Reporter, steps
from scdviz.scd import calibration, rate, transfer
from scdviz.scd import plan as plans
from scdviz.scd.calibration import CalibConfig, Calibration, domains_of, pair_identity
from scdviz.scd.patch import Patch, fit_patch, fit_patches
from scdviz.scd.rrr import LinearCode, RRRStats

# ----------------------------------------------------------------------------- fitting


@dataclass
class _Fits:
    """What the paired prefills of the fit windows give, per fold (domain) and layer."""

    kv_stats: list[list[RRRStats]]  # (folds, L) statistics of [pre-RoPE keys, values] rows, both sides
    rows: list[list[tuple]]  # (L,) per window: (fold, h_p, h_c, k_p, k_c, v_p, v_c), strided, fp16
    drift_k: list[float]  # (L,) raw reuse ‖K^P − K^C‖² / ‖K^C‖² (post-RoPE, token 0 excluded)
    drift_v: list[float]  # (L,)

    def _half(self, which: int) -> list[list[RRRStats]]:
        d = self.kv_stats[0][0].sx.numel() // 2
        h = slice(which * d, (which + 1) * d)
        return [[st.block(h, h) for st in fold] for fold in self.kv_stats]

    @functools.cached_property
    def k_stats(self) -> list[list[RRRStats]]:
        """(folds, L) the key block of ``kv_stats`` (views)."""
        return self._half(0)

    @functools.cached_property
    def v_stats(self) -> list[list[RRRStats]]:
        """(folds, L) the value block of ``kv_stats`` (views)."""
        return self._half(1)


def _stats_device(pair: Pair, n_folds: int) -> torch.device:
    """Where the REUSE statistics, and the linear algebra of every fit and choice on them, live: the consumer's GPU
    when it has one and they take at most half its free memory (fp64 there as here), else the host."""
    device = hf.device_of(pair.consumer)
    if device.type != "cuda":
        return hf.HOST
    d = 2 * hf.attn_heads(pair.producer)[1] * hf.attn_heads(pair.producer)[2]
    need = n_folds * hf.n_layers(pair.producer) * (2 * d * d + 3 * d) * 8
    return device if 2 * need <= torch.cuda.mem_get_info(device)[0] else hf.HOST


def _prefills(pair: Pair, windows: list[list[int]], folds: list[int], cfg: CalibConfig, progress,
              device: torch.device = hf.HOST) -> _Fits:
    """Paired prefills: REUSE statistics per fold (on ``device``), raw drift, and strided rows for aligners (token 0
    left out)."""
    n = hf.n_layers(pair.producer)
    d_kv = hf.attn_heads(pair.producer)[1] * hf.attn_heads(pair.producer)[2]
    n_folds = max(folds) + 1
    kv_stats = [[RRRStats(2 * d_kv, 2 * d_kv, device) for _ in range(n)] for _ in range(n_folds)]
    err = torch.zeros(n, 4, dtype=torch.float64, device=hf.HOST)  # ‖ΔK‖², ‖K^C‖², ‖ΔV‖², ‖V^C‖²
    rows: list[list[tuple]] = [[] for _ in range(n)]
    s = slice(1, None, cfg.h_stride)
    for window, fold in steps(list(zip(windows, folds)), "calibrate: paired prefills", progress):
        prefix = hf.ids_tensor(window[: cfg.prompt_len - 1])
        p = transfer.producer_state(pair.producer, prefix)
        c = transfer.producer_state(pair.consumer, prefix)
        for layer in range(n):
            kv_stats[fold][layer].add(torch.cat([p.keys_pre[layer][1:], p.values[layer][1:]], 1),
                                      torch.cat([c.keys_pre[layer][1:], c.values[layer][1:]], 1))
            err[layer] += torch.stack([
                ((p.keys[layer][1:] - c.keys[layer][1:]) ** 2).sum(), (c.keys[layer][1:] ** 2).sum(),
                ((p.values[layer][1:] - c.values[layer][1:]) ** 2).sum(), (c.values[layer][1:] ** 2).sum(),
            ]).double()
            rows[layer].append((fold, *(t[layer][s].half()
                                        for t in (p.h_in, c.h_in, p.keys_pre, c.keys_pre, p.values, c.values))))
    return _Fits(kv_stats, rows, (err[:, 0] / err[:, 1]).tolist(), (err[:, 2] / err[:, 3]).tolist())


def summed(stats: list, layer: int, keep=lambda fold: True) -> RRRStats:
    """``stats[fold][layer]`` (per fold a list over layers, or a dict of some layers) -> the statistics of
    the folds passing ``keep`` (fold index -> bool) at ``layer``, added up (one ``RRRStats`` of the same
    input and output dimensions)."""
    return functools.reduce(operator.add, [f[layer] for i, f in enumerate(stats) if keep(i)])


def lodo_error(stats: list, layer: int, ridge: float, shrink: float) -> float:
    """Mean over folds of the relative error of the full-rank map fitted on the other folds (``stats`` as
    ``summed`` takes them)."""
    errs = [stats[f][layer].heldout_error(*summed(stats, layer, lambda i, f=f: i != f).full_map(ridge, shrink))
            for f in range(len(stats))]
    return sum(errs) / len(errs)


def choose_shrink(fits: _Fits, cfg: CalibConfig) -> dict:
    """The REUSE maps' shrinkage and per-layer identity fallback (the identity code where it beats the map), both by
    leave-one-domain-out error.

    Returns {"shrink", "lodo_error" (shrink -> mean error over layers, K and V), "shrink_k",
    "shrink_v" (per layer: the shrinkage used, inf where the identity code won)}.
    """
    n = len(fits.k_stats[0])
    grid = list(cfg.shrink_grid)
    kinds = {"k": fits.k_stats, "v": fits.v_stats}
    per_layer = {alpha: {name: [lodo_error(st, layer, cfg.ridge, alpha) for layer in range(n)]
                         for name, st in kinds.items()}
                 for alpha in grid}  # alpha -> K/V -> (L,) held-out error
    table = {alpha: sum(sum(errs) for errs in e.values()) / (2 * n) for alpha, e in per_layer.items()}
    best = min(table, key=table.get)
    out = {"shrink": best, "lodo_error": {str(k): round(v, 5) for k, v in table.items()}}
    for name, st in kinds.items():
        chosen = []
        for layer in range(n):
            use_identity = lodo_error(st, layer, cfg.ridge, float("inf")) < per_layer[best][name][layer]
            chosen.append(float("inf") if use_identity else best)
        out[f"shrink_{name}"] = chosen
    return out


def _first_maps(st: RRRStats, ridge: float, alpha_k: float, alpha_v: float) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(μ_x, μ_y, [B_K, B_V]) of joint [K, V] statistics: the key and the value map, each fitted on its own block
    (shrinkages α_K, α_V); B₀ = diag(B_K, B_V)."""
    d = st.sx.numel() // 2
    halves = (slice(0, d), slice(d, 2 * d))
    maps = [st.block(h, h).full_map(ridge, a) for h, a in zip(halves, (alpha_k, alpha_v))]
    return torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps]), [m[2] for m in maps]


def joint_map(st: RRRStats, ridge: float, alpha_k: float, alpha_v: float, beta: float | None,
              rank: int) -> tuple[Tensor, Tensor, Tensor, LinearCode | None]:
    """(μ_x, μ_y, B, refinement) of one layer's REUSE from joint [K, V] statistics ``st``.

    The key and value maps (shrinkages α_K, α_V) give Ŷ = (X − μ_x) B₀ + μ_y, block-diagonal;
    the refinement is a rank-``rank`` ridge (β) regression of the residual Y − Ŷ on Ŷ, so the
    consumer, which holds only Ŷ, adds it. B is the whole map, B₀ (I + E D) (fp64), for
    held-out scoring; β None: no refinement. Fitted where ``st`` lives, returned on the host (with the
    host rows it is scored on, and to be saved).
    """
    mu_x, mu_y, blocks = _first_maps(st, ridge, alpha_k, alpha_v)
    b = torch.block_diag(*blocks)
    code = None
    if beta is not None:
        code = st.residual_of(mu_x, blocks, mu_y).fit(ridge + beta, rank, lean=True)
        mu_x, mu_y, b = _refined(mu_x, mu_y, b, code)
    return mu_x.to(hf.HOST), mu_y.to(hf.HOST), b.to(hf.HOST), None if code is None else code.to(hf.HOST)


def _refined(mu_x: Tensor, mu_y: Tensor, b: Tensor, code: LinearCode) -> tuple[Tensor, Tensor, Tensor]:
    """(μ_x, μ_y, B) of the first maps (μ_x, μ_y, B₀) followed by the refinement ``code``."""
    enc, dec = code.enc.double(), code.dec.double()
    shift = (mu_y - code.mu_in.double()) @ enc @ dec + code.mu_out.double()
    return mu_x, mu_y + shift, b + b @ enc @ dec


def kv_error(st: RRRStats, mu_x: Tensor, mu_y: Tensor, b: Tensor) -> float:
    """Mean of the relative key error and the relative value error of a joint map on THESE rows
    (outputs [K, V]; its input may be any rows): ``st`` holds (d_in -> 2 d) statistics, ``mu_x`` (d_in,),
    ``mu_y`` (2 d,) and ``b`` (d_in, 2 d), keys in the first d output columns, values in the last d.
    ``RRRStats.heldout_error`` of each half, sharing the input's second moment about μ_x."""
    d = st.sy.numel() // 2
    xx = st.about(mu_x)
    errs = []
    for h in (slice(0, d), slice(d, 2 * d)):
        half, m, bh = st.block(slice(None), h), mu_y[h], b[:, h]
        yy = half.syy.sum() - 2 * m @ half.sy + st.n * m @ m
        xy = half.sxy - torch.outer(st.sx, m) - torch.outer(mu_x, half.sy) + st.n * torch.outer(mu_x, m)
        errs.append(float((yy - 2 * (bh * xy).sum() + (bh * (xx @ bh)).sum()) / half.total()))
    return sum(errs) / 2


class _HeldOut:
    """One held-out fold's joint [K, V] statistics ready to score the first maps (μ_x, μ_y, diag(B_K, B_V)) fitted
    without it, and refinements of them, as ``kv_error`` does. A refinement makes B' = B₀ + F D with F = B₀ E
    (d_in, r) (``_refined``), so every term of the error of B' is the first maps' plus products with F: O(d² r)
    per refinement and rank once the d³ products with B₀ are made (here, once per fold)."""

    def __init__(self, st: RRRStats, mu_x: Tensor, mu_y: Tensor, blocks: list[Tensor]):
        d = st.sy.numel() // 2
        self.halves, self.blocks, self.mu_y, self.n = (slice(0, d), slice(d, 2 * d)), blocks, mu_y, st.n
        self.a = st.sx - st.n * mu_x  # Σ (x − μ_x)
        self.xx = st.about(mu_x)
        self.xy = st.sxy - torch.outer(st.sx, mu_y) - torch.outer(mu_x, st.sy) + st.n * torch.outer(mu_x, mu_y)
        self.c = st.sy - st.n * mu_y  # Σ (y − μ_y)
        self.yy, self.bxy, self.ab, self.bxxb, self.total = [], [], [], [], []
        for h, m in zip(self.halves, blocks):  # the first maps' terms; B₀'s half h is B_h in rows h
            half = st.block(slice(None), h)
            self.yy.append(half.syy.sum() - 2 * mu_y[h] @ half.sy + st.n * mu_y[h] @ mu_y[h])
            self.bxy.append((m * self.xy[h, h]).sum())
            self.ab.append(self.a[h] @ m)
            self.bxxb.append((m * (self.xx[h, h] @ m)).sum())
            self.total.append(half.total())

    def error(self) -> float:
        """``kv_error`` of the first maps."""
        return sum(float((yy - 2 * bxy + bxxb) / t)
                   for yy, bxy, bxxb, t in zip(self.yy, self.bxy, self.bxxb, self.total)) / 2

    def refined(self, code: LinearCode, ranks: list[int]) -> dict[int, float]:
        """rank -> ``kv_error`` of the first maps followed by ``code`` truncated to that rank (fp64 of its float32
        tensors, as ``_refined``)."""
        enc, dec = code.enc.double(), code.dec.double()
        f = torch.cat([m @ enc[h] for h, m in zip(self.halves, self.blocks)])  # B₀ E
        fxy, xxf = f.T @ self.xy, self.xx @ f  # Fᵀ xy (r, 2d), xx F (d_in, r)
        fxxf, af = f.T @ xxf, self.a @ f  # Fᵀ xx F (r, r), aᵀ F (r,)
        fxxb = [xxf[h].T @ m for h, m in zip(self.halves, self.blocks)]  # Fᵀ xx B₀'s half h (r, d)
        out = {}
        for r in ranks:
            shift = (self.mu_y - code.mu_in.double()) @ enc[:, :r] @ dec[:r] + code.mu_out.double()  # μ_y' − μ_y
            errs = []
            for i, h in enumerate(self.halves):
                dh, sh = dec[:r, h], shift[h]
                yy = self.yy[i] - 2 * sh @ self.c[h] + self.n * sh @ sh
                bxy = self.bxy[i] + (dh * fxy[:r, h]).sum() - (self.ab[i] + af[:r] @ dh) @ sh  # <B'_h, xy about μ_y'>
                bxxb = self.bxxb[i] + 2 * (dh * fxxb[i][:r]).sum() + (fxxf[:r, :r] * (dh @ dh.T)).sum()
                errs.append(float((yy - 2 * bxy + bxxb) / self.total[i]))
            out[r] = sum(errs) / 2
        return out


def joint_lodo(stats: list, layer: int, alpha_k: float, alpha_v: float, cfg: CalibConfig) -> dict:
    """(rank, β) -> the mean over folds of ``kv_error`` at ``layer`` of ``joint_map`` fitted on the other folds
    (``stats`` as ``summed`` takes them; (None, None): no refinement). The lower ranks are truncations of the
    highest-rank fit (the same as fitting them: RRR keeps the leading directions); per fold the first maps, their
    residual's statistics and the held-out fold's products with them are made once for every (rank, β)."""
    ranks = [cfg.joint_rank] if cfg.joint_rank is not None else list(cfg.joint_rank_grid)
    grid = [(None, None)] + [(r, beta) for r in ranks if r for beta in cfg.joint_shrink_grid]
    errs, n_folds = dict.fromkeys(grid, 0.0), len(stats)
    for f in range(n_folds):
        train = summed(stats, layer, lambda i, f=f: i != f)
        mu_x, mu_y, blocks = _first_maps(train, cfg.ridge, alpha_k, alpha_v)
        held = _HeldOut(stats[f][layer], mu_x, mu_y, blocks)
        errs[None, None] += held.error() / n_folds
        if not any(ranks):
            continue
        resid = train.residual_of(mu_x, blocks, mu_y)
        for beta in cfg.joint_shrink_grid:
            code = resid.fit(cfg.ridge + beta, max(ranks), lean=True)
            for r, e in held.refined(code, list(filter(None, ranks))).items():
                errs[r, beta] += e / n_folds
    return errs


def choose_joint(fits: _Fits, shrinks: dict, cfg: CalibConfig) -> dict:
    """The joint refinement's rank and ridge β, and the layers that get it, by leave-one-domain-out error.

    Returns {"rank", "shrink" (β; both None when no layer gains), "lodo_error" ("none" / "rank r, β"
    -> mean error over layers), "layers" (per layer: β or None)}.
    """
    n = len(fits.kv_stats[0])
    by_layer = [joint_lodo(fits.kv_stats, layer, shrinks["shrink_k"][layer], shrinks["shrink_v"][layer], cfg)
                for layer in range(n)]
    grid = list(by_layer[0])
    per_layer = {choice: [e[choice] for e in by_layer] for choice in grid}
    table = {choice: sum(errs) / n for choice, errs in per_layer.items()}
    best = min(table, key=table.get)
    rank, beta = best
    layers = [beta if rank is not None and per_layer[best][i] < per_layer[(None, None)][i] else None for i in range(n)]
    return {"rank": rank, "shrink": beta, "layers": layers,
            "lodo_error": {("none" if r is None else f"rank {r}, {b:g}"): round(v, 5) for (r, b), v in table.items()}}


def _rows_of(fits: _Fits, layer: int, keep) -> list[torch.Tensor]:
    """Concatenated (h_p, h_c, k_p, k_c, v_p, v_c) rows of the windows whose fold passes ``keep``."""
    picked = [r[1:] for r in fits.rows[layer] if keep(r[0])]
    return [torch.cat(col).float() for col in zip(*picked)]


def _patch_choice(consumer, fits: _Fits, layer: int, shrinks: dict, refine: tuple, weight, cfg: CalibConfig) -> dict:
    """The aligner's shrinkage and the gate, both by held-out-domain K/V error.

    Domains are grouped round-robin into ``cfg.gate_folds`` folds. Per fold, the linear
    aligners of every shrinkage (and the identity aligner) and the REUSE codes (with the layer's joint
    refinement, ``refine`` = (rank, ridge)) are fitted without the fold and scored on it. Returns {"shrink"
    (a number, or "identity"), "lodo_sse" (shrink -> linear aligner's held-out SSE), "patch_sse" (the chosen
    one's), "code_sse", "kept"}.
    """
    n_folds = min(cfg.gate_folds, len(fits.k_stats))
    grid = [*cfg.patch_shrink_grid, float("inf")]
    lodo, code_sse = dict.fromkeys(grid, 0.0), 0.0
    split = [(_rows_of(fits, layer, lambda g, f=f: g % n_folds != f),
              _rows_of(fits, layer, lambda g, f=f: g % n_folds == f))
             for f in range(n_folds)]

    param = next(consumer.parameters())

    def sse(patch: Patch, held: list[torch.Tensor]) -> float:  # K and V regenerated as the receiver does
        h = patch.decode(patch.encode(held[0])).to(device=param.device, dtype=param.dtype).unsqueeze(0)
        k, v = hf.kv_pre_from_hin(consumer, layer, h)
        got = torch.cat([transfer.flat(k), transfer.flat(v)], 1).float().to(hf.HOST)
        return float(((got - torch.cat([held[3], held[5]], 1).float()) ** 2).sum())

    for train, held in split:
        for alpha, patch in zip(grid, fit_patches(layer, train[0], train[1], weight, cfg.rank_h,
                                                  grid, cfg.ridge)):
            lodo[alpha] += sse(patch, held)
    best = min(lodo, key=lodo.get)
    for f, (_, held) in enumerate(split):
        _, _, kp, kc, vp, vc = held
        mu_x, mu_y, b, _ = joint_map(summed(fits.kv_stats, layer, lambda i, f=f: i % n_folds != f), cfg.ridge,
                                     shrinks["shrink_k"][layer], shrinks["shrink_v"][layer], refine[1], refine[0] or 0)
        code_sse += float((((torch.cat([kp, vp], 1).double() - mu_x) @ b + mu_y
                            - torch.cat([kc, vc], 1).double()) ** 2).sum())
    patch_sse = lodo[best]
    return {"shrink": "identity" if best == float("inf") else best,
            "lodo_sse": {("identity" if k == float("inf") else str(k)): round(v, 2) for k, v in lodo.items()},
            "patch_sse": round(patch_sse, 2), "code_sse": round(code_sse, 2), "kept": patch_sse < code_sse}


def _ideal_gains(pair: Pair, cases: list[transfer.Case], calib: Calibration, base: plans.Plan,
                 progress: bool | Reporter = True) -> list[float]:
    """KL drop of the base plan when one layer gets the consumer's own (oracle) K, V."""
    start = cases[0].state.ids.shape[1]
    totals = [0.0] * calib.n_layers
    base_kl = 0.0
    for case in steps(cases, "calibrate: ideal-patch gain per layer", progress):
        cache = transfer.transferred(pair.consumer, case.state, base, calib)
        keys, values = hf.cache_kv(cache)
        oracle_k, oracle_v = hf.cache_kv(case.oracle_cache)
        logits, _ = transfer.continuation(pair.consumer, cache, case.fed, start)
        base_kl += float(metrics.kl_per_token(case.oracle_logits, logits).mean())
        for layer in range(calib.n_layers):
            k2, v2 = list(keys), list(values)
            k2[layer], v2[layer] = oracle_k[layer], oracle_v[layer]
            logits, _ = transfer.continuation(pair.consumer, hf.make_cache(pair.consumer, k2, v2), case.fed, start)
            totals[layer] += float(metrics.kl_per_token(case.oracle_logits, logits).mean())
    return [(base_kl - t) / len(cases) for t in totals]


def _greedy(pair: Pair, cases, calib: Calibration, candidates: list[int], k: int,
            progress: bool | Reporter = True) -> tuple[list[int], list[float]]:
    """Patch layers added one at a time, each the candidate that lowers selection KL most.

    Layers of a payload are received independently, so each case's cache is received once
    reuse-only and once per candidate patch; every trial swaps the chosen layers' K, V in.
    """
    start = cases[0].state.ids.shape[1]
    base = plans.full_rank_plan(calib)
    parts = []  # per case: (reuse-only K, V lists, {candidate: (K, V) of its patched layer})
    for case in cases:
        keys, values = hf.cache_kv(transfer.transferred(pair.consumer, case.state, base, calib))
        own = {}
        for c in candidates:
            plan = plans.full_rank_plan(calib, [c])
            got = hf.cache_kv(transfer.transferred(pair.consumer, case.state, plan, calib))
            own[c] = (got[0][c], got[1][c])
        parts.append((keys, values, own))

    def kl(layers: list[int]) -> float:
        total = 0.0
        for case, (keys, values, own) in zip(cases, parts):
            k2, v2 = list(keys), list(values)
            for layer in layers:
                k2[layer], v2[layer] = own[layer]
            logits, _ = transfer.continuation(pair.consumer, hf.make_cache(pair.consumer, k2, v2), case.fed, start)
            total += float(metrics.kl_per_token(case.oracle_logits, logits).mean())
        return total / len(cases)

    chosen: list[int] = []
    kls = [kl([])]
    for _ in steps(range(min(k, len(candidates))), "calibrate: greedy patch placement", progress):
        scores = {c: kl(chosen + [c]) for c in candidates if c not in chosen}
        best = min(scores, key=scores.get)
        chosen.append(best)
        kls.append(scores[best])
    return chosen, kls


def calibrate(cfg: CalibConfig, pair: Pair, progress: bool | Reporter = True) -> Calibration:
    """Fit codes and aligners on a mixture of domains, select patch layers; see the module docstring.

    progress: a tqdm bar per step (True), nothing, or a reporter (``scdviz.progress``), which may stop the work."""
    t0 = time.perf_counter()
    windows, folds, select = calibration.windows(pair, cfg)
    fits = _prefills(pair, windows, folds, cfg, progress, _stats_device(pair, max(folds) + 1))
    shrinks = choose_shrink(fits, cfg)
    key_codes = [summed(fits.k_stats, layer).fit(cfg.ridge, cfg.max_rank, a).to(hf.HOST)
                 for layer, a in enumerate(shrinks["shrink_k"])]
    value_codes = [summed(fits.v_stats, layer).fit(cfg.ridge, cfg.max_rank, a).to(hf.HOST)
                   for layer, a in enumerate(shrinks["shrink_v"])]
    joint = choose_joint(fits, shrinks, cfg)
    refinements = [None if beta is None
                   else joint_map(summed(fits.kv_stats, layer), cfg.ridge, shrinks["shrink_k"][layer],
                                  shrinks["shrink_v"][layer], beta, joint["rank"])[3]
                   for layer, beta in enumerate(joint["layers"])]
    t_fit = time.perf_counter() - t0
    n = len(key_codes)
    cases = [transfer.prepare_case(pair.producer, pair.consumer, w, cfg.cont_len) for w in select]
    calib = Calibration(pair_identity(pair), cfg, key_codes, value_codes, {}, [], [], fits.drift_k, fits.drift_v,
                        [], [], {}, joint=refinements)
    gains = _ideal_gains(pair, cases, calib, plans.full_rank_plan(calib), progress)
    drift = [fits.drift_k[i] + fits.drift_v[i] for i in range(n)]
    by_drift = sorted(range(n), key=lambda i: -drift[i])
    by_gain = sorted(range(n), key=lambda i: -gains[i])
    want = cfg.given or by_gain[: cfg.n_candidates]
    candidates = sorted(set(want) | set(by_drift[: cfg.patch_k]))
    t1 = time.perf_counter()
    gates = {}
    for layer in steps(candidates, "calibrate: aligners", progress):
        weight = torch.cat(hf.kv_weights(pair.consumer, layer)).detach().float().to(hf.HOST)
        choice = gates[layer] = _patch_choice(pair.consumer, fits, layer, shrinks,
                                              (joint["rank"], joint["layers"][layer]), weight, cfg)
        hp, hc = _rows_of(fits, layer, lambda _: True)[:2]
        calib.patches[layer] = fit_patch(layer, hp, hc, weight, cfg.rank_h,
                                         shrink=float("inf") if choice["shrink"] == "identity" else choice["shrink"],
                                         ridge=cfg.ridge)
    t_align = time.perf_counter() - t1
    del fits  # the statistics (on the consumer's GPU where it has room) are done with before the greedy's prefills
    calib.drift_order = by_drift[: cfg.patch_k]
    calib.ideal_gain = gains
    if cfg.given:
        calib.patch_order, calib.selection_kl = list(cfg.given), []
    else:
        passed = [c for c in by_gain[: cfg.n_candidates] if gates[c]["kept"] or not cfg.gate_patches]
        calib.patch_order, calib.selection_kl = _greedy(pair, cases, calib, passed, cfg.patch_k, progress)
    calib.stats = {
        "domains": domains_of(cfg),
        "text": cfg.texts or "assets/text/<domain>/calib.txt",
        "fit_windows": len(windows),
        "select_windows": len(select),
        "fit_rows_per_layer": len(windows) * (cfg.prompt_len - 2),
        "shrink": shrinks["shrink"],
        "shrink_lodo_error": shrinks["lodo_error"],
        "identity_k": [i for i, a in enumerate(shrinks["shrink_k"]) if a == float("inf")],
        "identity_v": [i for i, a in enumerate(shrinks["shrink_v"]) if a == float("inf")],
        "joint_rank": joint["rank"],
        "joint_shrink": joint["shrink"],
        "joint_lodo_error": joint["lodo_error"],
        "joint_layers": [i for i, beta in enumerate(joint["layers"]) if beta is not None],
        "patch_gate": {str(k): v for k, v in gates.items()},
        "seconds_fit": round(t_fit, 1),
        "seconds_aligners": round(t_align, 1),
        "seconds_total": round(time.perf_counter() - t0, 1),
    }
    if cfg.rate_windows:
        calib.rate = rate.measure(pair, calib, cfg.rate_windows, progress)
        calib.stats["seconds_rate"] = round(calib.rate.seconds, 1)
        calib.stats["seconds_total"] = round(time.perf_counter() - t0, 1)
    calib.__dict__.pop("tag", None)  # the rate curves' payloads named it before its stats were final
    return calib
