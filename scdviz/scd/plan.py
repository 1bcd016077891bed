"""A transfer plan: per layer, what the producer sends and what the consumer does with it.

Layer modes:
  raw        producer's post-RoPE K and V, at ``raw_bits`` (16 = fp16; 4 or 8 = KIVI-style
             group-wise: keys per-channel, values per-token)
  code       REUSE: rank-r codes of pre-RoPE K and of V (scdviz.scd.rrr), at ``code_bits``,
             or transform coded (bits 0: a uniform step per section, entropy coded; the
             rank follows from the step, see scdviz.scd.entropy)
  patch      PATCH: a code of the normalised H_in; the consumer aligns it to its own H_in
             and regenerates K, V with its own projections (scdviz.scd.patch)
  recompute  the consumer runs each run of consecutive recompute layers itself, from the
             producer's residual stream entering it as it is (DroidSpeak-style, fp16)
Token 0 (the attention sink): ``sink="send"`` transfers it like any token;
``sink="recompute"`` leaves it out of every K/V/code section and the consumer
recomputes its own K, V for it with a 1-token forward.
A recomputed tail (``tail``, on any plan): the last ``tail`` tokens of the transferred prefix are
not sent; the consumer runs them itself, every layer, over the cache it built from the rest
(CacheBlend recomputes chosen tokens; here the latest, which the continuation reads most), so
their K, V and everything they attend through are the consumer's own.

Every method (raw reuse, 4-bit KV, DroidSpeak, SCD reuse-only, SCD full) is a Plan run
by the one machinery in scdviz.scd.transfer. Every plan decision lives here: the method
lineup, the calibration's operating point, rank allocation under a byte budget, the
sweeps and the app's controls. This module runs no model.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from scdviz.scd import payload
from scdviz.scd.rrr import allocate_ranks

if TYPE_CHECKING:
    from scdviz.scd.calibration import Calibration, RateCurves

MODES = payload.MODES  # layer modes, as the payload header writes them
SINKS = payload.SINKS  # token-0 handling
PAYLOAD_BITS = (2, 3, 4, 8, 16)  # the precisions a code section can travel at: packed integers (quant.BITS) or fp16


@dataclass
class Plan:
    """Per-layer transfer decisions for one method."""

    name: str  # method label used in results
    modes: list[str]  # (L,) one of MODES per layer
    rank_k: list[int] = field(default_factory=list)  # (L,) key code rank per layer ("code" layers)
    rank_v: list[int] = field(default_factory=list)  # (L,) value code rank per layer ("code" layers)
    raw_bits: int = 16  # bits of raw K/V sections
    raw_group: int = 32  # group size of quantised raw K/V
    raw_window: int = 0  # KIVI: the last this-many tokens of quantised raw K/V travel in fp16
    code_bits: int = 16  # bits of REUSE and PATCH code sections (unless bits_k / bits_v / bits_h say otherwise)
    code_group: int = 64  # group size (tokens per channel group) of quantised codes
    sink: str = "send"  # token-0 handling, one of SINKS
    bits_k: list[int] = field(default_factory=list)  # (L,) per-layer bits of key codes; empty: code_bits
    bits_v: list[int] = field(default_factory=list)  # (L,) per-layer bits of value codes; empty: code_bits
    bits_h: list[int] = field(default_factory=list)  # (L,) per-layer bits of PATCH codes; empty: code_bits
    entropy: bool = False  # entropy-code every quantised section (scdviz.scd.entropy); never more bytes
    steps_k: list[float] = field(default_factory=list)  # (L,) step of transform-coded key codes (bits 0)
    steps_v: list[float] = field(default_factory=list)  # (L,) step of transform-coded value codes
    rate_target: float = 0.0  # > 0: steps are relative; the producer scales them to this many payload bytes/token
    tail: int = 0  # the consumer recomputes the last this-many prefix tokens itself (not sent)

    def __post_init__(self) -> None:
        if self.tail < 0:
            raise ValueError(f"a recomputed tail is a number of tokens, 0 or more; got {self.tail}")
        bad = sorted(set(self.modes) - set(MODES))
        if bad:
            raise ValueError(f"unknown layer mode(s) {bad}; use {MODES}")
        if self.sink not in SINKS:
            raise ValueError(f"unknown sink handling {self.sink!r}; use {SINKS}")
        if "code" in self.modes and (len(self.rank_k) != len(self.modes) or len(self.rank_v) != len(self.modes)):
            raise ValueError("a plan with 'code' layers needs rank_k and rank_v for every layer")
        for what, bits in (("bits_k", self.bits_k), ("bits_v", self.bits_v), ("bits_h", self.bits_h)):
            if bits and len(bits) != len(self.modes):
                raise ValueError(f"{what} needs one entry per layer ({len(self.modes)}), got {len(bits)}")
            bad = sorted(set(bits) - set(PAYLOAD_BITS) - ({0} if what != "bits_h" else set()))
            if bad:
                raise ValueError(f"{what}: unsupported code bits {bad}; use {PAYLOAD_BITS}"
                                 + ("" if what == "bits_h" else " or 0 (transform coded)"))
        for bits, steps, what in ((self.bits_k, self.steps_k, "steps_k"), (self.bits_v, self.steps_v, "steps_v")):
            if 0 in bits and (len(steps) != len(self.modes)
                              or any(s <= 0 for i, s in enumerate(steps) if bits[i] == 0)):
                raise ValueError(f"transform-coded layers need a positive {what} entry for every layer")

    def bits_of(self, layer: int, kind: str) -> int:
        """Bits of a code section of ``layer``: kind "k", "v" or "h"."""
        per_layer = {"k": self.bits_k, "v": self.bits_v, "h": self.bits_h}[kind]
        return per_layer[layer] if per_layer else self.code_bits

    def layers_in(self, mode: str) -> list[int]:
        """Indices of the layers in ``mode``."""
        return [i for i, m in enumerate(self.modes) if m == mode]

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs [start, stop) of consecutive recompute layers."""
        return payload.recompute_runs(self.modes)


def prefill_share(modes: list[str], tail_share: float = 0.0) -> float:
    """The consumer's own compute for a plan of these layer modes as a share of its prefill's: the decoder
    layers it runs itself (recompute layers; "own": the oracle's) over all of them, for the tokens it
    did not recompute whole, plus ``tail_share`` (the recomputed tail's share of the prefix tokens), which
    runs every layer. Every layer and every token cost the same (the tail's attention over the whole prefix
    is counted as a token's average); decoding codes, patches' projections and the 1-token sink are left
    out (each well under 1% of a layer's compute on the built-in pair: see ``distil.footprint``)."""
    layers = sum(m in ("recompute", "own") for m in modes) / len(modes)
    return tail_share + (1 - tail_share) * layers


SENT = " (token 0 sent)"  # label suffix of a plan that sends the producer's token 0


def raw_plan(n_layers: int, bits: int = 16, group: int = 32, sink: str = "recompute", window: int = 0) -> Plan:
    """Reuse the producer's KV as is (bits 16) or quantised KIVI-style (bits 4/8), optionally
    with KIVI's full-precision window of the last ``window`` tokens."""
    name = "raw KV" if bits == 16 else f"{bits}-bit KV" + (f" +{window} fp16" if window else "")
    return Plan(name + (SENT if sink == "send" else ""), ["raw"] * n_layers, raw_bits=bits, raw_group=group,
                raw_window=window if bits < 16 else 0, sink=sink)


def droidspeak_plan(n_layers: int, recompute: list[int], sink: str = "recompute",
                    name: str = "DroidSpeak recompute") -> Plan:
    """Raw KV everywhere except ``recompute`` layers, which the consumer recomputes."""
    modes = ["recompute" if i in set(recompute) else "raw" for i in range(n_layers)]
    return Plan(name + (SENT if sink == "send" else ""), modes, sink=sink)


TAILS = (16, 32, 64)  # the tail sweep's recomputed tails (tokens), bench scd --tails


def with_tail(plan: Plan, tail: int) -> Plan:
    """``plan`` with the consumer recomputing the last ``tail`` prefix tokens itself (named for it)."""
    return dataclasses.replace(plan, name=f"{plan.name} + last {tail} recomputed", tail=tail)


_ADDED = re.compile(r" \+ last \d+ recomputed")  # with_tail's suffix


def base_name(name: str) -> str:
    """The name of the plan a tailed plan was made from (``with_tail``'s suffix removed; a closed-form twin stays
    one): what such a row is compared against."""
    return _ADDED.sub("", name)


def tail_sweep(calib: Calibration, tails: tuple[int, ...] = TAILS, budgets: tuple[float, ...] = ()) -> list[Plan]:
    """Raw KV (CacheBlend's way: the producer's cache, the latest tokens recomputed), SCD reuse-only at the
    operating point and SCD transform coded at each of ``budgets`` (needs the rate curves), each with each
    recomputed tail: KL against bytes and against the consumer's compute."""
    bases = [raw_plan(calib.n_layers), operating_plan(calib, patch_k=0, name="SCD reuse-only")]
    bases += [tc_plan(calib, b) for b in budgets]
    return [with_tail(p, t) for p in bases for t in tails]


def scd_plan(
    rank_k: list[int],
    rank_v: list[int],
    patch_layers: list[int] = (),
    code_bits: int = 4,
    code_group: int = 64,
    sink: str = "recompute",
    name: str | None = None,
) -> Plan:
    """SCD: REUSE codes on every layer, PATCH on ``patch_layers`` (reuse-only when empty)."""
    n = len(rank_k)
    patch = set(patch_layers)
    modes = ["patch" if i in patch else "code" for i in range(n)]
    label = name or ("SCD full" if patch else "SCD reuse-only")
    return Plan(label, modes, list(rank_k), list(rank_v), code_bits=code_bits, code_group=code_group, sink=sink)


def contiguous_block(scores: list[float], k: int) -> list[int]:
    """The k consecutive layers with the largest summed score (DroidSpeak recomputes a block)."""
    if k <= 0:
        return []
    sums = [sum(scores[i : i + k]) for i in range(len(scores) - k + 1)]
    start = max(range(len(sums)), key=sums.__getitem__)
    return list(range(start, start + k))


# ----------------------------------------------------------------------------- plans of a calibration


def full_ranks(calib: Calibration) -> tuple[list[int], list[int]]:
    """The largest stored rank of every layer's key and value code."""
    return [c.max_rank for c in calib.key_codes], [c.max_rank for c in calib.value_codes]


def full_rank_plan(calib: Calibration, patch_layers: list[int] = ()) -> Plan:
    """SCD at full stored rank with the calibration's code precision (used while calibrating)."""
    cfg = calib.config
    return scd_plan(*full_ranks(calib), list(patch_layers), code_bits=cfg.code_bits, code_group=cfg.code_group)


def code_dim_bytes(bits: int, group: int) -> float:
    """Payload bytes per token of one code dimension (codes + its share of fp16 min/step)."""
    return 2.0 if bits == 16 else bits / 8 + 4 / group


def budget_ranks(calib: Calibration, budget_bytes: float, bits: int, group: int,
                 patch_layers: list[int]) -> tuple[list[int], list[int]]:
    """Per-layer ranks (rank_k, rank_v) whose codes fit ``budget_bytes`` per token with the patches."""
    per_dim = code_dim_bytes(bits, group)
    patch_dims = sum(calib.patch_for(layer).rank_h for layer in patch_layers)
    total = int((budget_bytes - patch_dims * per_dim) / per_dim)
    reuse = [i for i in range(calib.n_layers) if i not in set(patch_layers)]
    codes = [calib.key_codes[i] for i in reuse] + [calib.value_codes[i] for i in reuse]
    ranks = allocate_ranks(codes, total)
    rank_k, rank_v = [0] * calib.n_layers, [0] * calib.n_layers
    for j, i in enumerate(reuse):
        rank_k[i], rank_v[i] = ranks[j], ranks[len(reuse) + j]
    return rank_k, rank_v


def operating_plan(
    calib: Calibration,
    patch_k: int | None = None,
    placement: str = "selected",
    budget_bytes: float | None = None,
    bits: int | None = None,
    name: str | None = None,
) -> Plan:
    """The SCD plan at the calibration's operating point (full-rank codes), with any knob overridden.

    placement: "selected" (patch_order, the configured selection) or "drift". budget_bytes: the
    rank-only allocation instead, ranks by fit error within this many payload bytes per token.
    """
    cfg = calib.config
    order = calib.patch_order if placement == "selected" else calib.drift_order
    k = min(cfg.op_patch_k, len(order)) if patch_k is None else patch_k
    if k > len(order):
        raise ValueError(f"this calibration orders {len(order)} patch layers; asked for {k}")
    chosen = order[:k]
    bits = cfg.code_bits if bits is None else bits
    if budget_bytes is None:
        rank_k, rank_v = full_ranks(calib)
    else:
        rank_k, rank_v = budget_ranks(calib, budget_bytes, bits, cfg.code_group, chosen)
    return scd_plan(rank_k, rank_v, chosen, code_bits=bits, code_group=cfg.code_group, name=name)


def tc_plan(calib: Calibration, budget_bytes: float, sink: str = "recompute", name: str | None = None) -> Plan:
    """SCD transform coded at a byte budget: every layer a full-rank REUSE code for K and V,
    quantised with one uniform step per section and entropy coded (scdviz.scd.entropy).

    Steps are set for equal slope of the predicted KL: a section's KL per unit of squared
    error in K/V space is its measured sensitivity (scdviz.scd.rate, KL per unit of relative
    error) over its energy (the code's fitted energy Σ s², its rank spectrum), and the error
    of a uniform step s is ∝ s², so the steps are ∝ 1 / sqrt(that). The producer scales them
    all by one factor per prompt so that the real payload (headers included) is at most
    ``budget_bytes`` per token (``transfer.build_payload``); channels whose integers are all
    zero are not sent, so each section's rank follows from its step.
    """
    if calib.rate is None:
        raise ValueError("transform coding needs the calibration's sensitivities: run `python -m scdviz rate` on it")
    n = calib.n_layers
    rank_k, rank_v = full_ranks(calib)

    def steps(codes, sens) -> list[float]:
        energy = torch.stack([(c.spectrum.double() ** 2).sum() for c in codes]).clamp_min(1e-30)
        return (energy / sens.double().clamp_min(1e-12)).sqrt().tolist()

    return Plan(name or f"SCD transform-coded @{budget_bytes:g} B/token", ["code"] * n, rank_k, rank_v,
                code_group=calib.config.code_group, sink=sink, bits_k=[0] * n, bits_v=[0] * n,
                steps_k=steps(calib.key_codes, calib.rate.sens_k), steps_v=steps(calib.value_codes, calib.rate.sens_v),
                rate_target=float(budget_bytes))


CLOSED = " (closed form)"  # the label suffix of an SCD plan run without the calibration's trained correction


def with_closed_form(lineup: list[Plan], calib: Calibration
                     ) -> tuple[list[Plan], list[Calibration]]:
    """``lineup`` and the calibration of each plan; with a trained correction stage (scdviz.scd.distil),
    every plan that sends REUSE codes again with the closed form, labelled ``CLOSED``, so the two
    are measured side by side on the same prompts."""
    if not calib.corrections:
        return lineup, [calib] * len(lineup)
    twins = [dataclasses.replace(p, name=p.name + CLOSED) for p in lineup if "code" in p.modes]
    return lineup + twins, [calib] * len(lineup) + [calib.closed_form()] * len(twins)


def lineup(calib: Calibration, scd_full: Plan | None = None, sink: str = "recompute") -> list[Plan]:
    """The methods of one run: raw KV, 4-bit KV, DroidSpeak, SCD reuse-only, SCD full.

    Every method treats token 0 (the attention sink) the same way, ``sink``: "recompute"
    (the consumer computes its own, the fair default) or "send" (labels end in SENT).
    DroidSpeak recomputes the contiguous block of ``op_patch_k`` layers with the largest
    ideal-patch gain, as many layers as SCD patches. scd_full: the SCD plan to compare
    (default: the calibration's operating point).
    """
    n = calib.n_layers
    tag = SENT if sink == "send" else ""
    full = scd_full or operating_plan(calib, name="SCD full")  # named so even when it patches nothing
    full = dataclasses.replace(full, name=full.name.removesuffix(SENT) + tag, sink=sink)
    reuse = dataclasses.replace(operating_plan(calib, patch_k=0), name="SCD reuse-only" + tag, sink=sink)
    block = contiguous_block(calib.ideal_gain, calib.config.op_patch_k)
    return [raw_plan(n, sink=sink), raw_plan(n, bits=4, sink=sink), droidspeak_plan(n, block, sink), reuse, full]


def droidspeak_sweep(calib: Calibration, ks: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[Plan]:
    """DroidSpeak's own bytes-vs-KL curve: the best contiguous block of k recomputed layers, each k."""
    n = calib.n_layers
    return [droidspeak_plan(n, contiguous_block(calib.ideal_gain, k), name=f"DroidSpeak k={k}") for k in ks if k <= n]


def patch_sweep(calib: Calibration, k_max: int | None = None) -> list[Plan]:
    """SCD plans with k = 0..k_max patch layers, for the selected and the drift placement."""
    k_max = min(k_max if k_max is not None else calib.config.patch_k, len(calib.patch_order), len(calib.drift_order))
    out = []
    for placement in ("selected", "drift"):
        label = ("given" if calib.config.given else "greedy") if placement == "selected" else "drift"
        out += [operating_plan(calib, k, placement, name=f"SCD k={k} ({label})") for k in range(k_max + 1)]
    return out


def rank_sweep(calib: Calibration, budgets: list[float]) -> list[Plan]:
    """SCD full at several byte budgets per token, ranks allocated by fit error alone at the
    calibration's code bits (approximate: section headers not counted)."""
    return [operating_plan(calib, budget_bytes=b, name=f"SCD rank-only @{b:g} B/token") for b in budgets]


def rd_plan(curves: RateCurves, budget_bytes: float, n_tokens: int, sink: str = "recompute",
            name: str | None = None) -> tuple[Plan, dict]:
    """The SCD plan for a byte budget chosen by measured rate–distortion (scdviz.scd.rate).

    Per layer: REUSE codes with a rank (0..r_max) and a precision (2, 3, 4, 8 bits or fp16)
    for keys and values separately, or a PATCH code (its precision) where the calibration
    has a patch. Minimises the predicted KL Σ sensitivity × relative error under a hard
    limit: the real payload of an ``n_tokens`` prompt (header, section headers and fp16
    scales included, token 0 per ``sink``) is at most ``budget_bytes`` per token. Method: the
    Lagrangian relaxation (each layer picks its best option for a price λ per byte, λ
    bisected to the budget), then greedy upgrades with the best KL drop per byte that still
    fit. Returns the plan and {predicted_kl, bytes_per_token, lambda}.
    """
    rows = n_tokens - 1 if sink == "recompute" else n_tokens
    g, bits, n = curves.group, list(curves.bits), curves.n_layers
    r_max = curves.err_k.shape[2] - 1
    f64 = dict(dtype=torch.float64, device="cpu")  # the planner works on host-side curves
    cost = torch.tensor([[payload.section_len(rows, r, b, g, "channel") for r in range(r_max + 1)] for b in bits],
                        **f64).flatten()
    dist = {"k": (curves.sens_k.double()[:, None, None] * curves.err_k.double()).flatten(1),  # (L, options)
            "v": (curves.sens_v.double()[:, None, None] * curves.err_v.double()).flatten(1)}
    p_cost = torch.tensor([[payload.section_len(rows, d, b, g, "channel") for b in bits] for d in curves.patch_dims],
                          **f64)
    p_dist = torch.stack([curves.sens_k.double()[curves.patch_layers], curves.sens_v.double()[curves.patch_layers]], 1)
    p_dist = (curves.patch_err.double() * p_dist[:, None, :]).sum(2) if curves.patch_layers else p_cost * 0
    allowed = budget_bytes * n_tokens - payload.header_len(curves.n_layers)

    def choose(lam: float) -> dict:
        pick = {kind: (dist[kind] + lam * cost).argmin(1) for kind in ("k", "v")}
        code_obj = sum(dist[kind].gather(1, pick[kind][:, None])[:, 0] + lam * cost[pick[kind]] for kind in ("k", "v"))
        patch = {}
        if curves.patch_layers:
            obj = p_dist + lam * p_cost
            best, which = obj.min(1)
            patch = {layer: int(which[i]) for i, layer in enumerate(curves.patch_layers) if best[i] < code_obj[layer]}
        return {"k": pick["k"].tolist(), "v": pick["v"].tolist(), "patch": patch}

    def spent(c: dict) -> float:
        total = 0.0
        for layer in range(n):
            if layer in c["patch"]:
                total += float(p_cost[curves.patch_layers.index(layer), c["patch"][layer]])
            else:
                total += float(cost[c["k"][layer]] + cost[c["v"][layer]])
        return total

    lo, hi = -30.0, 6.0  # log10 λ
    choice = choose(10**hi)
    if spent(choice) > allowed:
        least = (spent(choice) + payload.header_len(curves.n_layers)) / n_tokens
        raise ValueError(f"a budget of {budget_bytes:g} B/token is below the smallest SCD payload for {n_tokens} "
                         f"tokens ({least:.0f} B/token)")
    for _ in range(60):
        mid = (lo + hi) / 2
        c = choose(10**mid)
        if spent(c) <= allowed:
            hi, choice = mid, c
        else:
            lo = mid
    _fill(choice, dist, cost, p_dist, p_cost, curves.patch_layers, allowed - spent(choice))
    modes = ["patch" if layer in choice["patch"] else "code" for layer in range(n)]
    r_of = lambda i: i % (r_max + 1)  # noqa: E731  (option index -> rank, bits)
    b_of = lambda i: bits[i // (r_max + 1)]  # noqa: E731
    code = [m == "code" for m in modes]
    plan = Plan(
        name or f"SCD RD @{budget_bytes:g} B/token", modes,
        [r_of(choice["k"][i]) if code[i] else 0 for i in range(n)],
        [r_of(choice["v"][i]) if code[i] else 0 for i in range(n)],
        code_bits=4, code_group=g, sink=sink,
        bits_k=[b_of(choice["k"][i]) for i in range(n)], bits_v=[b_of(choice["v"][i]) for i in range(n)],
        bits_h=[bits[choice["patch"][i]] if i in choice["patch"] else 4 for i in range(n)],
    )
    predicted = sum(float(p_dist[curves.patch_layers.index(i), choice["patch"][i]]) if i in choice["patch"]
                    else float(dist["k"][i, choice["k"][i]] + dist["v"][i, choice["v"][i]]) for i in range(n))
    return plan, {"predicted_kl": predicted,
                  "bytes_per_token": (spent(choice) + payload.header_len(curves.n_layers)) / n_tokens,
                  "lambda": 10**hi}


def _fill(choice: dict, dist: dict, cost, p_dist, p_cost, patch_layers: list[int], left: float) -> None:
    """Greedy upgrades of single sections, best KL drop per byte first, while they fit ``left`` bytes."""
    while True:
        best = None  # (ratio, kind, layer, option, extra bytes)
        for kind in ("k", "v"):
            now = torch.tensor(choice[kind], device=cost.device)
            extra = cost[None, :] - cost[now][:, None]
            gain = dist[kind].gather(1, now[:, None]) - dist[kind]
            ok = (extra <= left) & (gain > 0)
            for layer in choice["patch"]:
                ok[layer] = False
            if ok.any():
                ratio = torch.where(ok, gain / extra.clamp_min(1e-9),
                                    torch.tensor(-1.0, dtype=gain.dtype, device=gain.device))
                flat = int(ratio.argmax())
                layer, option = divmod(flat, ratio.shape[1])
                if best is None or float(ratio[layer, option]) > best[0]:
                    best = (float(ratio[layer, option]), kind, layer, option, float(extra[layer, option]))
        for layer, b_now in choice["patch"].items():
            i = patch_layers.index(layer)
            for b in range(p_cost.shape[1]):
                extra, gain = float(p_cost[i, b] - p_cost[i, b_now]), float(p_dist[i, b_now] - p_dist[i, b])
                if extra <= left and gain > 0 and (best is None or gain / max(extra, 1e-9) > best[0]):
                    best = (gain / max(extra, 1e-9), "patch", layer, b, extra)
        if best is None:
            return
        _, kind, layer, option, extra = best
        if kind == "patch":
            choice["patch"][layer] = option
        else:
            choice[kind][layer] = option
        left -= extra


def user_plan(
    calib: Calibration,
    patch_k: int | None = None,
    placement: str = "selected",
    bits: int | None = None,
    rank_k: int | None = None,
    rank_v: int | None = None,
    layers: list[int] | None = None,
) -> Plan:
    """The SCD full plan from the app's controls.

    placement: "selected" (the calibration's order), "drift", or "manual" (``layers``).
    rank_k / rank_v: one rank for every layer (default: the operating point's ranks).
    """
    d_k, d_v = full_ranks(calib)
    for what, r, full in (("key", rank_k, max(d_k)), ("value", rank_v, max(d_v))):
        if r is not None and not 1 <= r <= full:
            raise ValueError(f"{what} rank {r} is out of range: this calibration stores ranks 1..{full}")
    if placement == "manual":
        patch_layers = sorted(set(layers or []))
        for layer in patch_layers:
            calib.patch_for(layer)  # ValueError naming the layers that have aligners
        base = operating_plan(calib, patch_k=0, bits=bits)
    else:
        base = operating_plan(calib, patch_k=patch_k, placement=placement, bits=bits)
        patch_layers = base.layers_in("patch")
    rk = [min(rank_k, d) for d in d_k] if rank_k else base.rank_k
    rv = [min(rank_v, d) for d in d_v] if rank_v else base.rank_v
    return scd_plan(rk, rv, patch_layers, code_bits=base.code_bits, code_group=base.code_group, name="SCD full")
