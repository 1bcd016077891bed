"""An SCD calibration as a user holds it: its settings, its fitted codes and aligners, save / load.

``Calibration`` is the artefact ``scdviz.scd.calibrate.calibrate`` returns: per layer the REUSE
codes of pre-RoPE keys and of values (scdviz.scd.rrr), the joint refinement, PATCH codes and
aligners for the candidate layers (scdviz.scd.patch), the patch order, the measured drift and
the rate-distortion curves (``RateCurves``, measured by scdviz.scd.rate). ``save(folder)`` /
``Calibration.load(folder, pair=None)`` write and read one safetensors file (scdviz.artefact);
``load`` refuses a calibration made for another pair. ``windows`` draws the calibration text
that fitting and the rate curves share. This module fits nothing and runs no model.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from scdviz import artefact, config, data, settings
from scdviz.config import opt
from scdviz.models.pair import Pair
from scdviz.scd.patch import Aligner, Patch
from scdviz.scd.rrr import LinearCode

SHIPPED_DIR = settings.ASSETS_DIR / "scd"  # shipped calibrations, one folder per built-in specialist
CODE_FIELDS = ("mu_in", "mu_out", "enc", "dec", "spectrum", "fit_err")
PATCH_FIELDS = ("in_mean", "in_std", "out_mean", "out_std")

RATE_TENSORS = ("err_k", "err_v", "patch_err", "sens_k", "sens_v")  # stored in the calibration file as rd.<name>
RATE_META = ("bits", "patch_layers", "patch_dims", "group", "n_windows", "seconds")  # stored in its header


@dataclass
class RateCurves:
    """Per-layer error curves and sensitivities of one calibration (see the module docstring)."""

    bits: list[int]  # code precisions, the second axis of the error tensors
    err_k: Tensor  # (L, n_bits, r_max + 1) relative key error at rank r
    err_v: Tensor  # (L, n_bits, r_max + 1) relative value error at rank r
    patch_layers: list[int]  # layers that can be patches (the calibration's patch order)
    patch_err: Tensor  # (P, n_bits, 2) relative key, value error of each patch layer
    patch_dims: list[int]  # (P,) width of each patch code (rank_h)
    sens_k: Tensor  # (L,) KL per unit of relative key error, measured
    sens_v: Tensor  # (L,) KL per unit of relative value error, measured
    group: int  # tokens per quantisation group of the codes
    n_windows: int  # calibration windows measured
    seconds: float  # time to measure

    @property
    def n_layers(self) -> int:
        return int(self.err_k.shape[0])


# settings a saved calibration's config may still hold that CalibConfig no longer has (read as today's recipe; their
# variants left in the one-recipe cleanup: docs/history.md): the aligner's MLP and its seed, the aligner fitted on H_in
# error, the rank-only operating point, pinned shrinkages, switching the identity fallback off, and the patch order by
# drift (with it the switch between the greedy and a given order: a given order is one given)
RETIRED_CONFIG = frozenset({"aligner_hidden", "aligner_steps", "seed", "aligner_loss", "budget_bytes", "shrink",
                            "patch_shrink", "identity_fallback", "selection"})


@dataclass
class CalibConfig:
    """Knobs of one calibration run."""

    domains: list[str] = opt([], "shipped corpora whose calib splits are mixed, windows spread evenly (default: every "
                             "shipped corpus)")
    texts: str | None = opt(None, "your text (.txt / .jsonl file, or a folder of train/calib/eval files): its calib "
                            "split is one more domain, mixed with --domains when given (alone it is split in 2 folds)")
    n_fit: int = opt(32, "windows for the fits, spread over the domains")
    n_select: int = opt(16, "further windows for patch selection (continuation KL), spread over the domains")
    prompt_len: int = opt(256, 'prompt tokens per window')
    cont_len: int = opt(32, 'continuation tokens scored during selection')
    ridge: float = opt(1e-3, 'RRR ridge, relative to the mean input eigenvalue')
    shrink_grid: tuple[float, ...] = opt((0.0, 0.03, 0.1, 0.3, 1.0, 3.0), "REUSE maps: candidate ridges on the "
                                         "correction toward identity, relative to the mean input eigenvalue, one "
                                         "chosen by leave-one-domain-out error")
    joint_rank: int | None = opt(None, "REUSE: rank of the joint refinement that maps the decoded keys and values "
                                 "together (each alone misses what the other carries of the producer's hidden state); "
                                 "0: none (default: chosen from joint_rank_grid with the ridge by leave-one-domain-out "
                                 "error)")
    joint_rank_grid: tuple[int, ...] = opt((16, 32, 64), "candidate refinement ranks (64 at most keeps a shipped "
                                           "calibration under 18 MB)")
    joint_shrink_grid: tuple[float, ...] = opt((0.0, 0.1, 0.3, 1.0), "candidate ridges of the joint refinement "
                                               "(relative), chosen by leave-one-domain-out error; a layer where it "
                                               "does not lower that error gets none")
    gate_patches: bool = opt(True, "drop a candidate patch whose aligner does not beat the REUSE code on held-out "
                             "domains")
    patch_shrink_grid: tuple[float, ...] = opt((0.1, 0.3, 1.0, 3.0, 10.0, 30.0), "aligners: candidate ridges on the "
                                               "linear correction toward the identity aligner, relative, one chosen "
                                               "per layer (or the identity aligner) by held-out-domain K/V error")
    gate_folds: int = opt(3, "the patch gate groups the domains into at most this many held-out folds (one aligner fit "
                          "each)")
    max_rank: int | None = opt(None, 'store codes up to this rank (None: full d_kv)')
    rank_h: int | None = opt(None, 'PATCH code width (None: the whole normalised H_in)')
    h_stride: int = opt(2, "keep every n-th token's H_in for aligner training (memory)")
    n_candidates: int = opt(10, 'layers (by ideal-patch gain) that get an aligner')
    patch_k: int = opt(8, 'patch layers kept in selection order (the budget sweep goes 0..patch_k)')
    given: list[int] = opt([], "patch layers in this order instead of the greedy order on selection KL (the patch "
                           "sweep labels them given)")
    code_bits: int = opt(4, "operating point: bits of code sections", choices=(4, 8, 16))
    code_group: int = opt(64, 'operating point: tokens per quantisation group of a code channel')
    op_patch_k: int = opt(6, 'operating point: patch layers used')
    rate_windows: int = opt(6, "calibration windows for the rate-distortion curves of the budget planner (0: none)")

@dataclass
class Calibration:
    """A fitted SCD calibration for one producer/consumer pair."""

    identity: dict  # who it belongs to: sources, tokenizer hash, weight fingerprints, facts
    config: CalibConfig  # how it was made
    key_codes: list[LinearCode]  # (L,) REUSE codes of pre-RoPE keys
    value_codes: list[LinearCode]  # (L,) REUSE codes of values
    patches: dict[int, Patch]  # layer -> PATCH code + aligner (candidates only)
    patch_order: list[int]  # patch layers in selection order (greedy, or as given)
    drift_order: list[int]  # candidate layers ordered by raw-reuse drift (largest first)
    drift_k: list[float]  # (L,) raw reuse ‖K^P − K^C‖² / ‖K^C‖² (post-RoPE, token 0 excluded)
    drift_v: list[float]  # (L,) same for values
    ideal_gain: list[float]  # (L,) KL drop of reuse-only when layer l gets the consumer's own K, V
    selection_kl: list[float]  # KL after adding each layer of patch_order (index 0: none)
    stats: dict  # data used, rows, seconds per stage
    rate: RateCurves | None = None  # rate-distortion curves for the budget planner (scdviz.scd.rate)
    # (L,) refinement of decoded [K_pre, V] rows, added to them; None: none
    joint: list[LinearCode | None] | None = None
    # the correction trained through the consumer (scdviz.scd.distil), by code layer, of its refined
    # [K_pre, V] rows (D = 2 d_kv): tensors a (D, r), b (r, D), s (D,), sigma (D,), tau (D,); None: the
    # closed form alone
    corrections: dict[int, dict[str, Tensor]] | None = None
    # (code layer, device) -> (what it was folded from, its receive map folded once: ``decoded``)
    _folded: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def closed_form(self) -> Calibration:
        """This calibration without its trained correction stage: the closed form training started from,
        under its own tag again (itself when it has no correction)."""
        if not self.corrections:
            return self
        return replace(self, corrections=None, stats={k: v for k, v in self.stats.items() if k != "distil"})

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

    def refined(self, layer: int, key_code: Tensor, value_code: Tensor, noise: tuple[Tensor, Tensor]
                ) -> tuple[Tensor, Tensor]:
        """A code layer's key and value codes -> its decoded, refined (K_pre, V) rows, step by step, before any
        trained correction (on the codes' device, float32)."""
        return self.refine(layer, self.key_codes[layer].decode(key_code), self.value_codes[layer].decode(value_code),
                           noise)

    def decoded(self, layer: int, key_code: Tensor, value_code: Tensor, noise: tuple[Tensor, Tensor],
                device: torch.device) -> tuple[Tensor, Tensor]:
        """A code layer's received (K_pre, V) rows (N, d_kv) each, float32 on ``device``, from its key and value
        codes (N, r_K), (N, r_V) and their quantisation noise (``refine_gain``): decoded, refined and corrected
        (``refine`` then ``correct``), in one map folded from the three. Each is affine in the codes, so the
        composition is: z = [z_K, z_V], x0 = z·blockdiag(D_K, D_V) + m0, l = (x0 − μ_J)·E_J (the refinement's
        latent), c = x0·a' (the correction's), and with the refinement's gain γ
            y = z·blockdiag(D_K, D_V)·S + m0·S + γ·μ'_J·S + [γ·l, c + γ·(l·D_J·a' + μ'_J·a')]·[D_J·S; b·τ]
        (S = diag(1 + s), a' = a / σ; l and c from one product z·blockdiag(D_K, D_V)·[E_J, a']): three products
        where the steps take five, and no row is written between them."""
        p = (self.corrections or {}).get(layer)
        sources = (self.key_codes[layer], self.value_codes[layer], self.joint[layer] if self.joint else None, p)
        hit = self._folded.get((layer, str(device)))
        if hit is None or any(a is not b for a, b in zip(hit[0], sources)):  # folded from what this layer holds now
            hit = self._folded[layer, str(device)] = (sources, {k: t.to(device) for k, t in self._fold(layer).items()})
        f = hit[1]
        gain = self.refine_gain(layer, noise) if self.joint and self.joint[layer] is not None else 0.0
        zk, zv = key_code.to(device=device, dtype=torch.float32), value_code.to(device=device, dtype=torch.float32)
        rk, rv, rj = zk.shape[1], zv.shape[1], f["joint_a"].shape[0]
        w_in = torch.cat([f["w_in"][:rk], f["w_in"][f["dec_k"].shape[0]:][:rv]])
        u = torch.addmm(f["in_bias"], torch.cat([zk, zv], 1), w_in)
        lat, c = u[:, :rj], u[:, rj:]
        if rj and c.shape[1]:
            c = c + gain * torch.addmm(f["joint_a_bias"], lat, f["joint_a"])
        rows = torch.addmm(f["bias"] + gain * f["joint_bias"], torch.cat([gain * lat, c], 1), f["w_out"])
        d_k = f["dec_k"].shape[1]
        rows[:, :d_k].addmm_(zk, f["dec_k"][:rk])
        rows[:, d_k:].addmm_(zv, f["dec_v"][:rv])
        return rows[:, :d_k], rows[:, d_k:]

    def _fold(self, layer: int) -> dict[str, Tensor]:
        """The matrices of ``decoded``'s folded map for one code layer (computed in float64, kept in float32)."""
        kc, vc = self.key_codes[layer], self.value_codes[layer]
        d, host = kc.dec.shape[1] + vc.dec.shape[1], dict(dtype=torch.float64, device=kc.dec.device)
        zeros = torch.zeros(d, 0, **host)
        p = (self.corrections or {}).get(layer)
        if p is None:
            a, bt, scale = zeros, zeros.T, torch.ones(d, **host)
        else:
            p = {k: t.to(**host) for k, t in p.items()}
            a, bt = p["a"] / p["sigma"][:, None], p["b"] * (p["tau"] if "tau" in p else 1.0)
            scale = 1 + p["s"]
        j = self.joint[layer] if self.joint else None
        if j is None:
            enc, dec, mu_in, mu_out = zeros, zeros.T, torch.zeros(d, **host), torch.zeros(d, **host)
        else:
            enc, dec, mu_in, mu_out = j.enc.double(), j.dec[: j.max_rank].double(), j.mu_in.double(), j.mu_out.double()
        dec_kv = torch.block_diag(kc.dec.double(), vc.dec.double())
        mean = torch.cat([kc.mu_out, vc.mu_out]).double()
        reads = torch.cat([enc, a], 1)
        out = {"w_in": dec_kv @ reads,
               "in_bias": mean @ reads - torch.cat([mu_in @ enc, torch.zeros(a.shape[1], **host)]),
               "joint_a": dec @ a, "joint_a_bias": mu_out @ a, "w_out": torch.cat([dec * scale, bt]),
               "bias": mean * scale, "joint_bias": mu_out * scale,
               "dec_k": kc.dec.double() * scale[: kc.dec.shape[1]], "dec_v": vc.dec.double() * scale[kc.dec.shape[1]:]}
        return {k: t.float() for k, t in out.items()}

    def correct(self, layer: int, keys_pre: Tensor, values: Tensor,
                corrections: dict[int, dict[str, Tensor]] | None = None) -> tuple[Tensor, Tensor]:
        """Refined REUSE rows (N, d_kv) each -> the same after the layer's trained correction, if it has one
        (``corrected`` on x = [K_pre, V]). ``corrections``: use these instead of the calibration's own."""
        rows = self.corrected(layer, torch.cat([keys_pre, values], 1), corrections)
        return rows[:, : keys_pre.shape[1]], rows[:, keys_pre.shape[1]:]

    def corrected(self, layer: int, rows: Tensor, corrections: dict[int, dict[str, Tensor]] | None = None) -> Tensor:
        """Rows x (N, D) -> ``y = x (1 + s) + ((x / sigma) a b) tau`` with the trained correction of ``layer``
        (scdviz.scd.distil; the identity when b and s are 0, where its training starts; tau, the output's
        scale per column, is 1 when absent), or x itself when there is none. ``corrections``: use these
        instead of the calibration's own."""
        p = ((self.corrections if corrections is None else corrections) or {}).get(layer)
        if p is None:
            return rows
        p = {k: v.to(device=rows.device, dtype=rows.dtype) for k, v in p.items()}
        a = p["a"] / p["sigma"][:, None]  # the scales folded into the (D, r) and (r, D) factors, not the N rows
        tau = p["tau"] if "tau" in p else 1.0
        return torch.addmm(rows * (1 + p["s"]), rows @ a, p["b"] * tau)

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

    @functools.cached_property
    def tag(self) -> int:
        """A 64-bit name of this calibration (its pair's identity, its settings and fit statistics),
        written into every payload that carries its codes so a receiver can refuse codes of another
        calibration. Never 0 (0 means "no calibration" in a payload header)."""
        blob = json.dumps([self.identity, config.to_dict(self.config), self.stats], sort_keys=True, default=str)
        return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:8], "little") or 1

    @property
    def n_layers(self) -> int:
        """Decoder layers."""
        return len(self.key_codes)

    def patch_for(self, layer: int) -> Patch:
        """The Patch of a layer; ValueError when this calibration has none there."""
        if layer not in self.patches:
            raise ValueError(f"this calibration has no aligner for layer {layer}; it has {sorted(self.patches)}")
        return self.patches[layer]

    def save(self, folder: str | Path, store_rank: int | None = None) -> Path:
        """Write ``folder/calibration.safetensors`` (int8 code matrices with an fp16 scale per rank component,
        int8 rows for aligner corrections
        and for the trained correction stage's factors;
        header: identity, config, fits).

        store_rank: keep codes only up to this rank (smaller files); default all.
        """
        tensors: dict[str, torch.Tensor] = {}
        codes = [("k", i, c.truncated(store_rank) if store_rank else c) for i, c in enumerate(self.key_codes)]
        codes += [("v", i, c.truncated(store_rank) if store_rank else c) for i, c in enumerate(self.value_codes)]
        codes += [("j", i, c) for i, c in enumerate(self.joint or []) if c is not None]  # refinements: never truncated
        for kind, layer, code in codes:
            for name in CODE_FIELDS:
                t = getattr(code, name)
                if name in _INT8_CODE_FIELDS:  # int8 with an fp16 scale per rank component: half of fp16's bytes
                    tensors[f"{kind}.{layer}.{name}"], tensors[f"{kind}.{layer}.{name}_scale"] = _int8_by_rank(
                        t, name)
                else:
                    tensors[f"{kind}.{layer}.{name}"] = t
        for layer, p in self.patches.items():
            for name in PATCH_FIELDS:
                tensors[f"p.{layer}.{name}"] = getattr(p, name)
            if p.basis is not None:
                tensors[f"p.{layer}.basis"] = p.basis.half()
            for name, t in p.aligner.state_dict().items():
                if name == "lin.weight":  # the correction Δ (d × d): int8 rows, so the file stays small
                    tensors[f"p.{layer}.aligner.{name}"], tensors[f"p.{layer}.lin_scale"] = artefact.int8_rows(t)
                else:
                    tensors[f"p.{layer}.aligner.{name}"] = t.half()
        if self.rate is not None:
            tensors.update({f"rd.{name}": getattr(self.rate, name) for name in RATE_TENSORS})
        for layer, params in (self.corrections or {}).items():
            tensors.update({f"c.{layer}.{name}": t for name, t in correction_tensors(params).items()})
        meta = {
            "rate": None if self.rate is None else {name: getattr(self.rate, name) for name in RATE_META},
            "patch_layers": sorted(self.patches),
            "patch_fit_err": {str(k): p.fit_err for k, p in self.patches.items()},
            "patch_order": self.patch_order,
            "drift_order": self.drift_order,
            "drift_k": self.drift_k,
            "drift_v": self.drift_v,
            "ideal_gain": self.ideal_gain,
            "selection_kl": self.selection_kl,
            "stats": self.stats,
        }
        artefact.save(Path(folder) / FILE, KIND, tensors, self.identity, config.to_dict(self.config), meta)
        return Path(folder)


    @classmethod
    def load(cls, folder: str | Path, pair: Pair | None = None) -> Calibration:
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

# ----------------------------------------------------------------------------- text

def domains_of(cfg: CalibConfig) -> list[str]:
    """The domains a calibration mixes: the user's text (with the given corpora, if any), the given
    corpora, or every shipped corpus."""
    names = list(cfg.domains) or ([] if cfg.texts else data.corpora())
    unknown = sorted(set(names) - set(data.corpora()))
    if unknown:
        raise ValueError(f"no shipped corpus named {', '.join(unknown)}; shipped: {', '.join(data.corpora())}")
    return ["texts", *names] if cfg.texts else names

def windows(pair: Pair, cfg: CalibConfig) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """(fit windows, their fold index, selection windows), spread evenly over the domains.

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
            raise ValueError(f"calibration text {name!r} gives {len(got)} windows of {length} tokens; need "
                             f"{per_fit + per_sel}")
        fit += got[:per_fit]
        folds += [i] * per_fit if len(names) > 1 else [j % 2 for j in range(per_fit)]
        select += got[per_fit:]
    return fit, folds, select

# ----------------------------------------------------------------------------- artefact

CORRECTION_FIELDS = ("a", "b", "s", "sigma", "tau")  # a correction's tensors (Calibration.corrected; "tau", the
# output's scale, is absent from the first ones: scale 1)
CORRECTION_FACTORS = ("a", "b")  # saved as int8 rows with an fp16 scale each


def correction_tensors(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """One correction's tensors as ``Calibration.save`` writes them (format 4): the factors a, b as int8 rows
    with an fp16 scale each (``{name}_scale``), the rest float32, tau left out when it equals sigma (as distil
    makes it) and written as 1 when absent (the first stages had none)."""
    params = dict(params)
    if "tau" not in params:
        params["tau"] = torch.ones_like(params["sigma"])
    elif torch.equal(params["tau"], params["sigma"]):
        del params["tau"]
    out = {}
    for name, t in params.items():
        if name in CORRECTION_FACTORS:
            out[name], out[name + "_scale"] = artefact.int8_rows(t.detach())
        else:
            out[name] = t.detach().float().clone()  # a copy: never the trained tensor itself
    return out


def stored(corrections: dict[int, dict[str, Tensor]]) -> dict[int, dict[str, Tensor]]:
    """``corrections`` as ``Calibration.save`` writes them and ``load`` reads them back (float32, the factors
    through their int8 rows), on their own device: what distil validates and keeps."""
    return {key: correction_of(correction_tensors(p), "", VERSION) for key, p in corrections.items()}


def correction_of(t: dict[str, torch.Tensor], prefix: str, version: int) -> dict[str, torch.Tensor]:
    """One saved correction (keys ``prefix + name``) as float32 tensors. Format 4 leaves out a tau equal to
    sigma (distil's) and stores any other; format 3 left out only a tau of 1 (the first stages had none)."""
    got = {name: correction_tensor(t, prefix + name) for name in CORRECTION_FIELDS if prefix + name in t}
    if "tau" not in got and version >= 4:
        got["tau"] = got["sigma"].clone()
    return got


def correction_tensor(t: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """A saved correction tensor as float32: int8 rows times their scale when ``key_scale`` is stored."""
    return artefact.from_int8_rows(t[key], t[key + "_scale"]) if key + "_scale" in t else t[key].float()

FILE = "calibration.safetensors"  # the artefact inside a calibration folder
KIND = "scd-calibration"
VERSION = artefact.VERSIONS[KIND]  # the format ``save`` writes

_INT8_CODE_FIELDS = ("enc", "dec")  # the code matrices, stored as int8 rows (enc by column: one rank component each)


def _int8_by_rank(t: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A code matrix as int8 in its own orientation and one fp16 scale (r, 1) per rank component: the
    decoder's rows (r, d_out) and the encoder's columns (d_in, r) (``artefact.int8_rows``)."""
    if name == "dec":
        return artefact.int8_rows(t)
    q, scale = artefact.int8_rows(t.T)
    return q.T.contiguous(), scale


def _code_field(t: dict[str, torch.Tensor], key: str, name: str) -> torch.Tensor:
    """One stored code field as float32: int8 code matrices scaled back (``_int8_by_rank``), fp16 ones
    (files written before int8) as they are."""
    value = t[key]
    if value.dtype != torch.int8:
        return value.float()
    scale = t[f"{key}_scale"].float()  # (r, 1)
    return value.float() * (scale if name == "dec" else scale.T)


def _from_artefact(art: artefact.Artefact) -> Calibration:
    t, meta = art.tensors, art.meta
    n = len(meta["drift_k"])

    def code(kind: str, layer: int) -> LinearCode:
        return LinearCode(*(_code_field(t, f"{kind}.{layer}.{name}", name) for name in CODE_FIELDS))

    cfg, _ = config.from_dict(CalibConfig, art.config, str(art.path))
    patches = {}
    for layer in meta["patch_layers"]:
        prefix = f"p.{layer}.aligner."
        if prefix + "up.weight" in t:
            raise ValueError(f"{art.path}: the aligner of layer {layer} has an MLP, a variant retired in the "
                             "one-recipe cleanup (docs/history.md); calibrate this pair again")
        aligner = Aligner(t[f"p.{layer}.in_mean"].numel())
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
        {i: correction_of(t, f"c.{i}.", art.version) for i in range(n) if f"c.{i}.a" in t} or None,
    )

def specialist_name(source: str) -> str:
    """'builtin:jargon' -> 'jargon'; a path or hub id -> its last component."""
    return source.split(":", 1)[1] if source.startswith("builtin:") else Path(source.rstrip("/")).name


def shipped_folder(consumer_source: str) -> Path:
    """Where the shipped calibration of a consumer lives (it may not exist)."""
    return SHIPPED_DIR / specialist_name(consumer_source)
