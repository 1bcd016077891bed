"""SCD calibration: fit REUSE codes and PATCH aligners on paired prefixes, choose patch layers.

``calibrate(pair, cfg)`` runs the same calibration windows through producer and consumer
and fits, per layer, reduced-rank codes for pre-RoPE keys and for values (token 0, the
attention sink, left out of every fit: the consumer recomputes it) and a low-rank joint
refinement of both, which the consumer adds to the decoded rows (keys and values are two
projections of one hidden state, so each carries some of what the other misses; kept per
layer only where it lowers the leave-one-domain-out error), measures raw-reuse
drift, ranks layers by the KL gain of an *ideal* patch (the consumer's own K, V at that
layer), trains aligners for the candidates and orders patch layers greedily on
continuation KL (or by drift, or as given). ``save`` / ``load`` write and read the
artefact (one safetensors file, scdviz.artefact); ``load`` refuses one made for another pair.

It does not evaluate on held-out text (scdviz.scd.measure).
"""

from __future__ import annotations

import functools
import operator
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from scdviz import artefact, config, data, metrics, settings
from scdviz.config import opt
from scdviz.models import hf
from scdviz.models.pair import Pair
from scdviz.scd import plan as plans
from scdviz.scd import rate, transfer
from scdviz.scd.patch import Aligner, Patch, fit_patch, fit_patches
from scdviz.scd.rate import RATE_META, RATE_TENSORS, RateCurves
from scdviz.scd.rrr import LinearCode, RRRStats

SELECTIONS = ("greedy", "drift", "given")
SHIPPED_DIR = settings.ASSETS_DIR / "scd"  # shipped calibrations, one folder per built-in specialist
CODE_FIELDS = ("mu_in", "mu_out", "enc", "dec", "spectrum", "fit_err")
PATCH_FIELDS = ("in_mean", "in_std", "out_mean", "out_std")


@dataclass
class CalibConfig:
    """Knobs of one calibration run."""

    domains: list[str] = opt([], "shipped corpora whose calib splits are mixed, windows spread evenly (default: every shipped corpus)")
    texts: str | None = opt(None, "your text (.txt / .jsonl file, or a folder of train/calib/eval files): its calib split is one more domain, mixed with --domains when given (alone it is split in 2 folds)")
    n_fit: int = opt(32, "windows for the fits, spread over the domains")
    n_select: int = opt(16, "further windows for patch selection (continuation KL), spread over the domains")
    prompt_len: int = opt(256, 'prompt tokens per window')
    cont_len: int = opt(32, 'continuation tokens scored during selection')
    ridge: float = opt(1e-3, 'RRR ridge, relative to the mean input eigenvalue')
    shrink: float | None = opt(None, "REUSE maps: ridge on the correction toward identity, relative to the mean input eigenvalue (default: chosen from shrink_grid by leave-one-domain-out error)")
    shrink_grid: tuple[float, ...] = opt((0.0, 0.03, 0.1, 0.3, 1.0, 3.0), "candidate shrinkages for the leave-one-domain-out choice")
    identity_fallback: bool = opt(True, "per layer and K/V, use the identity code where it beats the map on held-out domains")
    joint_rank: int | None = opt(None, "REUSE: rank of the joint refinement that maps the decoded keys and values together (each alone misses what the other carries of the producer's hidden state); 0: none (default: chosen from joint_rank_grid with the ridge by leave-one-domain-out error)")
    joint_rank_grid: tuple[int, ...] = opt((16, 32, 64), "candidate refinement ranks (64 at most keeps a shipped calibration under 18 MB)")
    joint_shrink_grid: tuple[float, ...] = opt((0.0, 0.1, 0.3, 1.0), "candidate ridges of the joint refinement (relative), chosen by leave-one-domain-out error; a layer where it does not lower that error gets none")
    gate_patches: bool = opt(True, "drop a candidate patch whose aligner does not beat the REUSE code on held-out domains")
    patch_shrink: float | None = opt(None, "aligners: ridge on the linear correction toward the identity aligner, relative (default: chosen per layer from patch_shrink_grid and the identity aligner by held-out-domain K/V error)")
    patch_shrink_grid: tuple[float, ...] = opt((0.1, 0.3, 1.0, 3.0, 10.0, 30.0), "candidate aligner shrinkages for the held-out-domain choice")
    gate_folds: int = opt(3, "the patch gate groups the domains into at most this many held-out folds (one aligner fit each)")
    max_rank: int | None = opt(None, 'store codes up to this rank (None: full d_kv)')
    rank_h: int | None = opt(None, 'PATCH code width (None: the whole normalised H_in)')
    aligner_hidden: int = opt(128, 'aligner MLP width')
    aligner_steps: int = opt(300, 'Adam steps per aligner')
    aligner_loss: str = opt("kv", 'kv: error of the regenerated K, V; h: normalised H_in error', choices=("kv", "h"))
    h_stride: int = opt(2, "keep every n-th token's H_in for aligner training (memory)")
    n_candidates: int = opt(10, 'layers (by ideal-patch gain) that get an aligner')
    patch_k: int = opt(8, 'patch layers kept in selection order (the budget sweep goes 0..patch_k)')
    selection: str = opt("greedy", "patch-layer order: greedy on selection KL, by drift, or as given", choices=SELECTIONS)
    given: list[int] = opt([], "patch layers for --selection given")
    code_bits: int = opt(4, "operating point: bits of code sections", choices=(4, 8, 16))
    code_group: int = opt(64, 'operating point: tokens per quantisation group of a code channel')
    budget_bytes: float | None = opt(None, 'operating point: payload bytes/token (None: full rank)')
    op_patch_k: int = opt(6, 'operating point: patch layers used')
    rate_windows: int = opt(6, "calibration windows for the rate-distortion curves of the budget planner (0: none)")
    seed: int = opt(0, 'aligner initialisation and batches')

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown patch selection {self.selection!r}; use one of {SELECTIONS}")
        if self.selection == "given" and not self.given:
            raise ValueError("selection 'given' needs a list of patch layers")
        if self.aligner_loss not in ("kv", "h"):
            raise ValueError("aligner_loss must be 'kv' or 'h'")


@dataclass
class Calibration:
    """A fitted SCD calibration for one producer/consumer pair."""

    identity: dict  # who it belongs to: sources, tokenizer hash, weight fingerprints, facts
    config: CalibConfig  # how it was made
    key_codes: list[LinearCode]  # (L,) REUSE codes of pre-RoPE keys
    value_codes: list[LinearCode]  # (L,) REUSE codes of values
    patches: dict[int, Patch]  # layer -> PATCH code + aligner (candidates only)
    patch_order: list[int]  # patch layers in selection order (greedy, drift or given)
    drift_order: list[int]  # candidate layers ordered by raw-reuse drift (largest first)
    drift_k: list[float]  # (L,) raw reuse ‖K^P − K^C‖² / ‖K^C‖² (post-RoPE, token 0 excluded)
    drift_v: list[float]  # (L,) same for values
    ideal_gain: list[float]  # (L,) KL drop of reuse-only when layer l gets the consumer's own K, V
    selection_kl: list[float]  # KL after adding each layer of patch_order (index 0: none)
    stats: dict  # data used, rows, seconds per stage
    rate: RateCurves | None = None  # rate-distortion curves for the budget planner (scdviz.scd.rate)
    joint: list[LinearCode | None] | None = None  # (L,) refinement of decoded [K_pre, V] rows, added to them; None: none

    def refine(self, layer: int, keys_pre: Tensor, values: Tensor, noise: tuple | None = None) -> tuple[Tensor, Tensor]:
        """Decoded REUSE rows (N, d_kv) each -> the same after the layer's joint refinement (if any);
        ``noise``: the codes' quantisation noise (see ``refine_gain``), None for clean full-rank codes."""
        code = self.joint[layer] if self.joint else None
        if code is None:
            return keys_pre, values
        rows = torch.cat([keys_pre, values], 1)
        gain = 1.0 if noise is None else self.refine_gain(layer, noise)
        rows = rows + gain * code.decode(code.encode(rows, code.max_rank))
        return rows[:, : keys_pre.shape[1]], rows[:, keys_pre.shape[1]:]

    def refine_gain(self, layer: int, noise: tuple[Tensor, Tensor]) -> float:
        """The refinement's weight γ = S / (S + E‖eM‖²) when its input is decoded codes, not clean ones.

        The refinement (fitted on clean codes) is a least-squares predictor of the first maps'
        residual, so its clean output r has E⟨r, residual⟩ = E‖r‖² = S, the energy per row it
        explained at calibration. Quantisation adds an error e to its input, so eM to its output
        (M its 384 × 384 map); with e independent of the rest, the γ that minimises
        E‖residual − γ(r + eM)‖² is S / (S + E‖eM‖²). ``noise`` (keys, values): per SENT code channel
        the expected squared error of a decoded value (payload.Section.noise; zeros at fp16).
        Channels not sent (a truncated code) miss their whole variance, and no sent channel's
        error exceeds its variance. Energies per row come from the calibration's fit rows.
        """
        rows = self.stats.get("fit_rows_per_layer")
        if not rows:
            return 1.0
        var = []
        for n, c in zip(noise, (self.key_codes[layer], self.value_codes[layer])):
            signal = c.spectrum.double() ** 2 / rows  # variance of each code channel per row
            sent = torch.minimum(signal[: n.numel()], n.double().to(signal.device))
            var.append(torch.cat([sent, signal[sent.numel():]]))
        explained = float((self.joint[layer].spectrum.double() ** 2).sum()) / rows
        added = float((torch.cat(var) * self._refine_leverage[layer]).sum())
        return explained / (explained + added) if explained > 0 else 0.0

    @functools.cached_property
    def _refine_leverage(self) -> list[Tensor | None]:
        """Per layer (r_K + r_V,) ‖d_c M‖²: how far a unit error in key or value code channel c moves
        the refinement's output (d_c the channel's decoder row). Derived from the codes, computed at the
        first use (a calibration's codes do not change after it is made or loaded)."""
        out = []
        for layer, code in enumerate(self.joint or [None] * self.n_layers):
            if code is None:
                out.append(None)
                continue
            dec = torch.block_diag(self.key_codes[layer].dec.double(), self.value_codes[layer].dec.double())
            out.append(((dec @ code.enc.double()) @ code.dec.double()).pow(2).sum(1))
        return out

    @property
    def n_layers(self) -> int:
        """Decoder layers."""
        return len(self.key_codes)

    def patch_for(self, layer: int) -> Patch:
        """The Patch of a layer; ValueError when this calibration has none there."""
        if layer not in self.patches:
            raise ValueError(f"this calibration has no aligner for layer {layer}; it has {sorted(self.patches)}")
        return self.patches[layer]


# ----------------------------------------------------------------------------- identity


IDENTITY_LABELS = {"tokenizer_hash": "tokenizer", "producer_fingerprint": "producer weights",
                   "consumer_fingerprint": "consumer weights"}


def pair_identity(pair: Pair) -> dict:
    """What an artefact records about its pair."""
    return {
        "producer_source": pair.producer_source,
        "consumer_source": pair.consumer_source,
        "tokenizer_hash": pair.producer_facts.tokenizer_hash,
        "producer_fingerprint": artefact.fingerprint(pair.producer),
        "consumer_fingerprint": artefact.fingerprint(pair.consumer),
        "facts": asdict(pair.consumer_facts),
    }


def check_identity(saved: dict, pair: Pair, where: str) -> None:
    """PairError saying which part differs when ``saved`` is not this pair's identity."""
    artefact.check_identity(saved, pair_identity(pair), IDENTITY_LABELS, f"the SCD calibration in {where}",
                            lambda i: f"producer {i.get('producer_source')!r} -> consumer {i.get('consumer_source')!r}",
                            "Calibrate this pair: python -m scdviz calibrate")


# ----------------------------------------------------------------------------- fitting


def domains_of(cfg: CalibConfig) -> list[str]:
    """The domains a calibration mixes: the user's text (with the given corpora, if any), the given
    corpora, or every shipped corpus."""
    names = list(cfg.domains) or ([] if cfg.texts else data.corpora())
    unknown = sorted(set(names) - set(data.corpora()))
    if unknown:
        raise ValueError(f"no shipped corpus named {', '.join(unknown)}; shipped: {', '.join(data.corpora())}")
    return ["texts", *names] if cfg.texts else names


def windows(pair: Pair, cfg: CalibConfig) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """(fit windows, their fold index, selection windows), spread evenly over the domains: lists of
    ``cfg.prompt_len + cfg.cont_len`` token ids each (``cfg.n_fit`` and ``cfg.n_select``
    rounded up to a multiple of the number of domains).

    Folds are the domains; a single domain (e.g. a user's text alone) is split into two folds of
    alternating windows, so the shrinkage is still chosen on windows it was not fitted on.
    """
    names = domains_of(cfg)
    length = cfg.prompt_len + cfg.cont_len
    per_fit, per_sel = -(-cfg.n_fit // len(names)), -(-cfg.n_select // len(names))
    fit, folds, select = [], [], []
    for i, name in enumerate(names):
        passages = data.passages(name, "calib", cfg.texts)
        got = data.token_windows(pair.tokenizer, passages, length, per_fit + per_sel)
        if len(got) < per_fit + per_sel:
            raise ValueError(f"calibration text {name!r} gives {len(got)} windows of {length} tokens; need {per_fit + per_sel}")
        fit += got[:per_fit]
        folds += [i] * per_fit if len(names) > 1 else [j % 2 for j in range(per_fit)]
        select += got[per_fit:]
    return fit, folds, select


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
    for window, fold in tqdm(list(zip(windows, folds)), desc="calibrate: paired prefills", disable=not progress):
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
            rows[layer].append((fold, *(t[layer][s].half() for t in (p.h_in, c.h_in, p.keys_pre, c.keys_pre, p.values, c.values))))
    return _Fits(kv_stats, rows, (err[:, 0] / err[:, 1]).tolist(), (err[:, 2] / err[:, 3]).tolist())


def summed(stats: list[list[RRRStats]], layer: int, keep=lambda fold: True) -> RRRStats:
    """``stats[fold][layer]`` -> the statistics of the folds passing ``keep`` (fold index -> bool) at
    ``layer``, added up (one ``RRRStats`` of the same input and output dimensions)."""
    return functools.reduce(operator.add, [f[layer] for i, f in enumerate(stats) if keep(i)])


def _lodo_error(stats: list[list[RRRStats]], layer: int, ridge: float, shrink: float) -> float:
    """Mean over folds of the relative error of the full-rank map fitted on the other folds."""
    errs = [stats[f][layer].heldout_error(*summed(stats, layer, lambda i, f=f: i != f).full_map(ridge, shrink))
            for f in range(len(stats))]
    return sum(errs) / len(errs)


def choose_shrink(fits: _Fits, cfg: CalibConfig) -> dict:
    """The REUSE maps' shrinkage and per-layer identity fallback, both by leave-one-domain-out error.

    Returns {"shrink", "lodo_error" (shrink -> mean error over layers, K and V), "shrink_k",
    "shrink_v" (per layer: the shrinkage used, inf where the identity code won)}.
    """
    n = len(fits.k_stats[0])
    grid = [cfg.shrink] if cfg.shrink is not None else list(cfg.shrink_grid)
    kinds = {"k": fits.k_stats, "v": fits.v_stats}
    per_layer = {alpha: {name: [_lodo_error(st, layer, cfg.ridge, alpha) for layer in range(n)] for name, st in kinds.items()}
                 for alpha in grid}  # alpha -> K/V -> (L,) held-out error
    table = {alpha: sum(sum(errs) for errs in e.values()) / (2 * n) for alpha, e in per_layer.items()}
    best = min(table, key=table.get)
    out = {"shrink": best, "lodo_error": {str(k): round(v, 5) for k, v in table.items()}}
    for name, st in kinds.items():
        chosen = []
        for layer in range(n):
            use_identity = cfg.identity_fallback and (
                _lodo_error(st, layer, cfg.ridge, float("inf")) < per_layer[best][name][layer])
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
            mu_x, mu_y, b, _ = joint_map(train, cfg.ridge, shrinks["shrink_k"][layer], shrinks["shrink_v"][layer], None, 0)
            errs[None, None] += kv_error(fits.kv_stats[f][layer], mu_x, mu_y, b) / n_folds
            for beta in cfg.joint_shrink_grid if any(ranks) else ():
                code = train.residual_of(mu_x, b, mu_y).fit(cfg.ridge + beta, max(ranks))
                for r in filter(None, ranks):
                    errs[r, beta] += kv_error(fits.kv_stats[f][layer], *_refined(mu_x, mu_y, b, code.truncated(r))) / n_folds
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


def _patch_choice(fits: _Fits, layer: int, shrinks: dict, refine: tuple, weight, cfg: CalibConfig) -> dict:
    """The aligner's shrinkage, whether its MLP helps, and the gate, all by held-out-domain K/V error.

    Domains are grouped round-robin into ``cfg.gate_folds`` folds. Per fold, the linear
    aligners of every shrinkage (and the identity aligner), the MLP on top of the best one,
    and the REUSE codes (with the layer's joint refinement, ``refine`` = (rank, ridge)) are fitted without the
    fold and scored on it. Returns {"shrink"
    (a number, or "identity"), "lodo_sse" (shrink -> linear aligner's held-out SSE),
    "mlp" (the MLP lowered it), "patch_sse", "code_sse", "kept"}.
    """
    n_folds = min(cfg.gate_folds, len(fits.k_stats))
    grid = [cfg.patch_shrink] if cfg.patch_shrink is not None else [*cfg.patch_shrink_grid, float("inf")]
    kv_weight = weight if cfg.aligner_loss == "kv" else None
    w = weight.float().T
    lodo, mlp_sse, code_sse = dict.fromkeys(grid, 0.0), 0.0, 0.0
    split = [(_rows_of(fits, layer, lambda g, f=f: g % n_folds != f), _rows_of(fits, layer, lambda g, f=f: g % n_folds == f))
             for f in range(n_folds)]

    def sse(patch: Patch, held: list[torch.Tensor]) -> float:
        return float(((patch.decode(patch.encode(held[0])) @ w - torch.cat([held[3], held[5]], 1)) ** 2).sum())

    for train, held in split:
        for alpha, patch in zip(grid, fit_patches(layer, train[0], train[1], kv_weight, cfg.rank_h,
                                                  grid, cfg.ridge)):
            lodo[alpha] += sse(patch, held)
    best = min(lodo, key=lodo.get)
    for f, (train, held) in enumerate(split):
        if cfg.aligner_steps:
            mlp_sse += sse(fit_patch(layer, train[0], train[1], kv_weight, cfg.rank_h, cfg.aligner_hidden, cfg.aligner_steps,
                                     seed=cfg.seed, shrink=best, ridge=cfg.ridge), held)
        _, _, kp, kc, vp, vc = held
        mu_x, mu_y, b, _ = joint_map(summed(fits.kv_stats, layer, lambda i, f=f: i % n_folds != f), cfg.ridge,
                                     shrinks["shrink_k"][layer], shrinks["shrink_v"][layer], refine[1], refine[0] or 0)
        code_sse += float((((torch.cat([kp, vp], 1).double() - mu_x) @ b + mu_y - torch.cat([kc, vc], 1).double()) ** 2).sum())
    use_mlp = bool(cfg.aligner_steps) and mlp_sse < lodo[best]
    patch_sse = mlp_sse if use_mlp else lodo[best]
    return {"shrink": "identity" if best == float("inf") else best,
            "lodo_sse": {("identity" if k == float("inf") else str(k)): round(v, 2) for k, v in lodo.items()},
            "mlp": use_mlp, "mlp_sse": round(mlp_sse, 2) if cfg.aligner_steps else None,
            "patch_sse": round(patch_sse, 2), "code_sse": round(code_sse, 2), "kept": patch_sse < code_sse}


def _ideal_gains(pair: Pair, cases: list[transfer.Case], calib: Calibration, base: plans.Plan) -> list[float]:
    """KL drop of the base plan when one layer gets the consumer's own (oracle) K, V."""
    start = cases[0].state.ids.shape[1]
    totals = [0.0] * calib.n_layers
    base_kl = 0.0
    for case in tqdm(cases, desc="calibrate: ideal-patch gain per layer"):
        got = transfer.receive(pair.consumer, transfer.build_payload(case.state, base, calib), base, calib)
        keys, values = hf.cache_kv(got.cache)
        oracle_k, oracle_v = hf.cache_kv(case.oracle_cache)
        logits, _ = transfer.continuation(pair.consumer, got.cache, case.fed, start)
        base_kl += float(metrics.kl_per_token(case.oracle_logits, logits).mean())
        for layer in range(calib.n_layers):
            k2, v2 = list(keys), list(values)
            k2[layer], v2[layer] = oracle_k[layer], oracle_v[layer]
            logits, _ = transfer.continuation(pair.consumer, hf.make_cache(pair.consumer, k2, v2), case.fed, start)
            totals[layer] += float(metrics.kl_per_token(case.oracle_logits, logits).mean())
    return [(base_kl - t) / len(cases) for t in totals]


def _greedy(pair: Pair, cases, calib: Calibration, candidates: list[int], k: int) -> tuple[list[int], list[float]]:
    """Patch layers added one at a time, each the candidate that lowers selection KL most.

    Layers of a payload are received independently, so each case's cache is received once
    reuse-only and once per candidate patch; every trial swaps the chosen layers' K, V in.
    """
    start = cases[0].state.ids.shape[1]
    base = plans.full_rank_plan(calib)
    parts = []  # per case: (reuse-only K, V lists, {candidate: (K, V) of its patched layer})
    for case in cases:
        keys, values = hf.cache_kv(transfer.receive(pair.consumer, transfer.build_payload(case.state, base, calib), base, calib).cache)
        own = {}
        for c in candidates:
            plan = plans.full_rank_plan(calib, [c])
            got = hf.cache_kv(transfer.receive(pair.consumer, transfer.build_payload(case.state, plan, calib), plan, calib).cache)
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
    for _ in tqdm(range(min(k, len(candidates))), desc="calibrate: greedy patch placement"):
        scores = {c: kl(chosen + [c]) for c in candidates if c not in chosen}
        best = min(scores, key=scores.get)
        chosen.append(best)
        kls.append(scores[best])
    return chosen, kls


def calibrate(pair: Pair, cfg: CalibConfig, progress=True) -> Calibration:
    """Fit codes and aligners on a mixture of domains, select patch layers; see the module docstring."""
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    fit_windows, folds, select = windows(pair, cfg)
    fits = _prefills(pair, fit_windows, folds, cfg, progress)
    shrinks = choose_shrink(fits, cfg)
    total_k = [summed(fits.k_stats, layer) for layer in range(len(fits.drift_k))]
    total_v = [summed(fits.v_stats, layer) for layer in range(len(fits.drift_k))]
    key_codes = [st.fit(cfg.ridge, cfg.max_rank, a) for st, a in zip(total_k, shrinks["shrink_k"])]
    value_codes = [st.fit(cfg.ridge, cfg.max_rank, a) for st, a in zip(total_v, shrinks["shrink_v"])]
    joint = choose_joint(fits, shrinks, cfg)
    refinements = [None if beta is None else joint_map(summed(fits.kv_stats, layer), cfg.ridge, shrinks["shrink_k"][layer],
                                                       shrinks["shrink_v"][layer], beta, joint["rank"])[3]
                   for layer, beta in enumerate(joint["layers"])]
    t_fit = time.perf_counter() - t0
    n = len(key_codes)
    cases = [transfer.prepare_case(pair.producer, pair.consumer, w, cfg.cont_len) for w in select]
    calib = Calibration(pair_identity(pair), cfg, key_codes, value_codes, {}, [], [], fits.drift_k, fits.drift_v, [], [], {},
                        joint=refinements)
    gains = _ideal_gains(pair, cases, calib, plans.full_rank_plan(calib))
    drift = [fits.drift_k[i] + fits.drift_v[i] for i in range(n)]
    by_drift = sorted(range(n), key=lambda i: -drift[i])
    by_gain = sorted(range(n), key=lambda i: -gains[i])
    want = cfg.given if cfg.selection == "given" else by_gain[: cfg.n_candidates]
    candidates = sorted(set(want) | set(by_drift[: cfg.patch_k]))
    t1 = time.perf_counter()
    gates = {}
    for layer in tqdm(candidates, desc="calibrate: aligners", disable=not progress):
        weight = torch.cat(hf.kv_weights(pair.consumer, layer)).detach().float().to(hf.HOST)
        choice = gates[layer] = _patch_choice(fits, layer, shrinks, (joint["rank"], joint["layers"][layer]), weight, cfg)
        hp, hc = _rows_of(fits, layer, lambda _: True)[:2]
        calib.patches[layer] = fit_patch(layer, hp, hc, weight if cfg.aligner_loss == "kv" else None, cfg.rank_h,
                                         cfg.aligner_hidden, cfg.aligner_steps if choice["mlp"] else 0, seed=cfg.seed,
                                         shrink=float("inf") if choice["shrink"] == "identity" else choice["shrink"],
                                         ridge=cfg.ridge)
    t_align = time.perf_counter() - t1
    calib.drift_order = by_drift[: cfg.patch_k]
    calib.ideal_gain = gains
    if cfg.selection == "greedy":
        passed = [c for c in by_gain[: cfg.n_candidates] if gates[c]["kept"] or not cfg.gate_patches]
        calib.patch_order, calib.selection_kl = _greedy(pair, cases, calib, passed, cfg.patch_k)
    else:
        calib.patch_order = list(cfg.given) if cfg.selection == "given" else calib.drift_order
        calib.selection_kl = []
    calib.stats = {
        "domains": domains_of(cfg),
        "text": cfg.texts or "assets/text/<domain>/calib.txt",
        "fit_windows": len(fit_windows),
        "select_windows": len(select),
        "fit_rows_per_layer": len(fit_windows) * (cfg.prompt_len - 2),
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
    return calib


# ----------------------------------------------------------------------------- artefact

FILE = "calibration.safetensors"  # the artefact inside a calibration folder
KIND = "scd-calibration"


def save(calib: Calibration, folder: str | Path, store_rank: int | None = None) -> Path:
    """Write ``folder/calibration.safetensors`` (fp16 code matrices, int8 rows for aligner corrections;
    header: identity, config, fits).

    store_rank: keep codes only up to this rank (smaller files); default all.
    """
    tensors: dict[str, torch.Tensor] = {}
    codes = [("k", i, c.truncated(store_rank) if store_rank else c) for i, c in enumerate(calib.key_codes)]
    codes += [("v", i, c.truncated(store_rank) if store_rank else c) for i, c in enumerate(calib.value_codes)]
    codes += [("j", i, c) for i, c in enumerate(calib.joint or []) if c is not None]  # refinements: never truncated
    for kind, layer, code in codes:
        for name in CODE_FIELDS:
            t = getattr(code, name)
            tensors[f"{kind}.{layer}.{name}"] = t.half() if name in ("enc", "dec") else t
    for layer, p in calib.patches.items():
        for name in PATCH_FIELDS:
            tensors[f"p.{layer}.{name}"] = getattr(p, name)
        if p.basis is not None:
            tensors[f"p.{layer}.basis"] = p.basis.half()
        for name, t in p.aligner.state_dict().items():
            if name == "lin.weight":  # the correction Δ (d × d): int8 rows, so the file stays small
                tensors[f"p.{layer}.aligner.{name}"], tensors[f"p.{layer}.lin_scale"] = artefact.int8_rows(t)
            else:
                tensors[f"p.{layer}.aligner.{name}"] = t.half()
    if calib.rate is not None:
        tensors.update({f"rd.{name}": getattr(calib.rate, name) for name in RATE_TENSORS})
    meta = {
        "rate": None if calib.rate is None else {name: getattr(calib.rate, name) for name in RATE_META},
        "patch_layers": sorted(calib.patches),
        "patch_fit_err": {str(k): p.fit_err for k, p in calib.patches.items()},
        "patch_order": calib.patch_order,
        "drift_order": calib.drift_order,
        "drift_k": calib.drift_k,
        "drift_v": calib.drift_v,
        "ideal_gain": calib.ideal_gain,
        "selection_kl": calib.selection_kl,
        "stats": calib.stats,
    }
    artefact.save(Path(folder) / FILE, KIND, tensors, calib.identity, config.to_dict(calib.config), meta)
    return Path(folder)


def load(folder: str | Path, pair: Pair | None = None) -> Calibration:
    """Read a calibration folder; with ``pair``, PairError unless it was made for that pair.

    A folder that is not a complete calibration (missing or damaged file, other format
    version, missing field or tensor) raises ValueError saying which part is wrong.
    """
    folder = Path(folder)
    if not (folder / FILE).is_file():
        raise ValueError(f"no SCD calibration in {folder} ({FILE} missing); run python -m scdviz calibrate")
    art = artefact.load(folder / FILE, KIND)
    if pair is not None:
        check_identity(art.identity, pair, str(folder))
    try:
        return _from_artefact(art)
    except (KeyError, IndexError, TypeError, RuntimeError) as err:
        raise ValueError(f"{folder} is not a complete SCD calibration ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:200] if str(err) else ''}); make it again") from None


def _from_artefact(art: artefact.Artefact) -> Calibration:
    t, meta = art.tensors, art.meta
    n = len(meta["drift_k"])

    def code(kind: str, layer: int) -> LinearCode:
        return LinearCode(*(t[f"{kind}.{layer}.{name}"].float() for name in CODE_FIELDS))

    cfg, _ = config.from_dict(CalibConfig, art.config, str(art.path))
    patches = {}
    for layer in meta["patch_layers"]:
        prefix = f"p.{layer}.aligner."
        up = t.get(prefix + "up.weight")
        aligner = Aligner(t[f"p.{layer}.in_mean"].numel(), 0 if up is None else up.shape[0])
        state = {k[len(prefix) :]: v.float() for k, v in t.items() if k.startswith(prefix)}
        state["lin.weight"] = artefact.from_int8_rows(t[prefix + "lin.weight"], t[f"p.{layer}.lin_scale"])
        aligner.load_state_dict(state)
        basis = t.get(f"p.{layer}.basis")
        patches[layer] = Patch(
            layer, *(t[f"p.{layer}.{name}"] for name in PATCH_FIELDS),
            basis.float() if basis is not None else None, aligner.eval(), meta["patch_fit_err"][str(layer)],
        )
    curves = None
    if meta.get("rate"):
        curves = RateCurves(**{name: t[f"rd.{name}"] for name in RATE_TENSORS}, **meta["rate"])
    return Calibration(
        art.identity, cfg, [code("k", i) for i in range(n)], [code("v", i) for i in range(n)], patches,
        meta["patch_order"], meta["drift_order"], meta["drift_k"], meta["drift_v"], meta["ideal_gain"],
        meta["selection_kl"], meta["stats"], curves,
        [code("j", i) if f"j.{i}.enc" in t else None for i in range(n)],
    )


def specialist_name(source: str) -> str:
    """'builtin:jargon' -> 'jargon'; a path or hub id -> its last component."""
    return source.split(":", 1)[1] if source.startswith("builtin:") else Path(source.rstrip("/")).name


def shipped_folder(consumer_source: str) -> Path:
    """Where the shipped calibration of a consumer lives (it may not exist)."""
    return SHIPPED_DIR / specialist_name(consumer_source)
