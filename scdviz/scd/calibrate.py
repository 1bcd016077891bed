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


def _prefills(pair: Pair, windows: list[list[int]], folds: list[int], cfg: CalibConfig, progress) -> _Fits:
    """Paired prefills: REUSE statistics per fold, raw drift, and strided rows for aligners (token 0 left out)."""
    n = hf.n_layers(pair.producer)
    d_kv = hf.attn_heads(pair.producer)[1] * hf.attn_heads(pair.producer)[2]
    n_folds = max(folds) + 1
    kv_stats = [[RRRStats(2 * d_kv, 2 * d_kv) for _ in range(n)] for _ in range(n_folds)]
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


def joint_map(st: RRRStats, ridge: float, alpha_k: float, alpha_v: float, beta: float | None,
              rank: int) -> tuple[Tensor, Tensor, Tensor, LinearCode | None]:
    """(μ_x, μ_y, B, refinement) of one layer's REUSE from joint [K, V] statistics ``st``.

    The key and value maps (shrinkages α_K, α_V) give Ŷ = (X − μ_x) B₀ + μ_y, block-diagonal;
    the refinement is a rank-``rank`` ridge (β) regression of the residual Y − Ŷ on Ŷ, so the
    consumer, which holds only Ŷ, adds it. B is the whole map, B₀ (I + E D) (fp64), for
    held-out scoring; β None: no refinement.
    """
    d = st.sx.numel() // 2
    halves = (slice(0, d), slice(d, 2 * d))
    maps = [st.block(h, h).full_map(ridge, a) for h, a in zip(halves, (alpha_k, alpha_v))]
    mu_x, mu_y = torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps])
    b = torch.block_diag(maps[0][2], maps[1][2])
    if beta is None:
        return mu_x, mu_y, b, None
    code = st.residual_of(mu_x, b, mu_y).fit(ridge + beta, rank)
    return (*_refined(mu_x, mu_y, b, code), code)


def _refined(mu_x: Tensor, mu_y: Tensor, b: Tensor, code: LinearCode) -> tuple[Tensor, Tensor, Tensor]:
    """(μ_x, μ_y, B) of the first maps (μ_x, μ_y, B₀) followed by the refinement ``code``."""
    enc, dec = code.enc.double(), code.dec.double()
    shift = (mu_y - code.mu_in.double()) @ enc @ dec + code.mu_out.double()
    return mu_x, mu_y + shift, b + b @ enc @ dec


def kv_error(st: RRRStats, mu_x: Tensor, mu_y: Tensor, b: Tensor) -> float:
    """Mean of the relative key error and the relative value error of a joint map on THESE rows
    (outputs [K, V]; its input may be any rows): ``st`` holds (d_in -> 2 d) statistics, ``mu_x`` (d_in,),
    ``mu_y`` (2 d,) and ``b`` (d_in, 2 d), keys in the first d output columns, values in the last d."""
    d = st.sy.numel() // 2
    return sum(st.block(slice(None), h).heldout_error(mu_x, mu_y[h], b[:, h])
               for h in (slice(0, d), slice(d, 2 * d))) / 2


def choose_joint(fits: _Fits, shrinks: dict, cfg: CalibConfig) -> dict:
    """The joint refinement's rank and ridge β, and the layers that get it, by leave-one-domain-out error.

    Returns {"rank", "shrink" (β; both None when no layer gains), "lodo_error" ("none" / "rank r, β"
    -> mean error over layers), "layers" (per layer: β or None)}.
    """
    n, n_folds = len(fits.kv_stats[0]), len(fits.kv_stats)
    ranks = [cfg.joint_rank] if cfg.joint_rank is not None else list(cfg.joint_rank_grid)
    grid = [(None, None)] + [(r, beta) for r in ranks if r for beta in cfg.joint_shrink_grid]

    def lodo(layer: int) -> dict:
        """(rank, β) -> mean held-out error at this layer; the lower ranks are truncations of the
        highest-rank fit (the same as fitting them: RRR keeps the leading directions)."""
        errs = dict.fromkeys(grid, 0.0)
        for f in range(n_folds):
            train = summed(fits.kv_stats, layer, lambda i, f=f: i != f)
            mu_x, mu_y, b, _ = joint_map(train, cfg.ridge, shrinks["shrink_k"][layer], shrinks["shrink_v"][layer],
                                         None, 0)
            errs[None, None] += kv_error(fits.kv_stats[f][layer], mu_x, mu_y, b) / n_folds
            for beta in cfg.joint_shrink_grid if any(ranks) else ():
                code = train.residual_of(mu_x, b, mu_y).fit(cfg.ridge + beta, max(ranks))
                for r in filter(None, ranks):
                    errs[r, beta] += kv_error(fits.kv_stats[f][layer],
                                              *_refined(mu_x, mu_y, b, code.truncated(r))) / n_folds
        return errs

    by_layer = [lodo(layer) for layer in range(n)]
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
    fits = _prefills(pair, windows, folds, cfg, progress)
    shrinks = choose_shrink(fits, cfg)
    total_k = [summed(fits.k_stats, layer) for layer in range(len(fits.drift_k))]
    total_v = [summed(fits.v_stats, layer) for layer in range(len(fits.drift_k))]
    key_codes = [st.fit(cfg.ridge, cfg.max_rank, a) for st, a in zip(total_k, shrinks["shrink_k"])]
    value_codes = [st.fit(cfg.ridge, cfg.max_rank, a) for st, a in zip(total_v, shrinks["shrink_v"])]
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
