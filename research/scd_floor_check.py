"""Where SCD's KL stops falling: more input for the REUSE maps, and other reconstructions of the coded values.

    python -m research.scd_floor_check                 # every built-in specialist
    python -m research.scd_floor_check austen-before   # one
    python -m research.scd_floor_check --eval          # part 3 only
    python -m research.scd_floor_check --error         # part 2's squared errors only (no KL run)

Parts 1 and 2 are measured on calibration text (the shipped calibration's fit windows, split by
domain, and its selection windows), never on eval text: they decide whether an idea is worth
building, so they may not see the text the README's tables report on. Part 3 reads eval text and
decides nothing.

Part 1, more input for the maps: the leave-one-domain-out relative error (mean of keys' and
values') of a full-rank ridge map predicting the consumer's [pre-RoPE K, V] of layer l from the
producer's [K, V] of layers l-w .. l+w (w = 0: the layer alone, the input the shipped maps have),
at several ridges. If neighbouring layers carried much of what one layer's 384 dimensions miss of
the 576-dimensional hidden state, this error would fall with w.

Part 2, the floor and the quantiser, on the selection windows (18 for the shipped calibrations):
KL of raw reuse, of the full-rank codes sent in fp16 (nothing lost to quantisation: the floor any
coder at any budget approaches), and of the transform-coded plan at 2,304 and 3,840 B/token with
three reconstructions of each quantised value: the bin centre (what the decoder does), the bin's
conditional mean under a per-channel Laplacian whose rate follows from the channel's sent scale
(the least-squares reconstruction: lower error per value), and an energy-keeping gain
(E[x²] / E[x·x̂] per channel under the same model, so that the reconstruction is not shrunk
toward zero). Ratios are paired over the windows (percentile bootstrap). First, on the same
payloads, each reconstruction's squared error per value (equal-slope weights), against the centre's.

Part 3 (``--eval`` alone), the floor on the text the README reports: the same floor on the
specialist's own eval split, the 16 prompts of 256 + 32 tokens of the budget table
(``bench scd --config assets/scd/NAME/bench.toml``): raw reuse, the full-rank codes in fp16 and
in int4 (the table's "SCD reuse-only") and transform coded at both budgets, so a budget target
can be set against what the maps allow at any number of bytes. It chooses nothing.
"""

from __future__ import annotations

import argparse

import torch

from scdviz import data, metrics
from scdviz.models import builtin, hf
from scdviz.models.pair import load_pair
from scdviz.scd import bench, calibration, entropy, measure, payload, transfer
from scdviz.scd import calibrate as cal
from scdviz.scd import plan as plans
from scdviz.scd.rrr import RRRStats

WIDTHS = (0, 1, 2)
RIDGES = (1e-3, 1e-2, 3e-2, 0.1)
BUDGETS = (2304, 3840)


def neighbours(layer: int, width: int, n: int) -> list[int]:
    return [j for j in range(layer - width, layer + width + 1) if 0 <= j < n]


def more_input(pair, calib, name: str) -> None:
    cfg = calib.config
    windows, folds, _ = calibration.windows(pair, cfg)
    n, n_folds = calib.n_layers, max(folds) + 1
    d = 2 * calib.key_codes[0].dec.shape[1]
    stats = {w: [[RRRStats(d * len(neighbours(i, w, n)), d) for i in range(n)] for _ in range(n_folds)] for w in WIDTHS}
    for window, fold in zip(windows, folds):
        prefix = hf.ids_tensor(window[: cfg.prompt_len - 1])
        p, c = transfer.producer_state(pair.producer, prefix), transfer.producer_state(pair.consumer, prefix)
        x = [torch.cat([p.keys_pre[i][1:], p.values[i][1:]], 1) for i in range(n)]
        y = [torch.cat([c.keys_pre[i][1:], c.values[i][1:]], 1) for i in range(n)]
        for w in WIDTHS:
            for i in range(n):
                stats[w][fold][i].add(torch.cat([x[j] for j in neighbours(i, w, n)], 1), y[i])
    for ridge in RIDGES:
        errs = {}
        for w in WIDTHS:
            errs[w] = sum(cal.kv_error(stats[w][f][i],
                                       *cal.summed(stats[w], i, lambda g, f=f: g != f).full_map(ridge, 0.0))
                          for i in range(n) for f in range(n_folds)) / (n * n_folds)
        cells = "  ".join(f"layers l±{w}: {e:.4f}" for w, e in errs.items())
        print(f"more input  {name:10s} ridge {ridge:<6g} held-out-domain K/V error  {cells}", flush=True)
    print(f"more input  {name:10s} shipped maps + joint refinement: {calib.stats.get('joint_lodo_error')}", flush=True)


def _channel_rates(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers (rows, cols) -> (each channel's scale code as sent, the rate λ per step of the
    zero-mean Laplacian whose rounded integers have that code's mean square)."""
    codes = entropy.scale_codes(q.to(torch.int32))
    ms = entropy.stds(codes) ** 2
    lo, hi = torch.full_like(ms, -12.0), torch.full_like(ms, 6.0)  # bisection on log λ: E[q²] falls as λ grows
    for _ in range(48):
        mid = (lo + hi) / 2
        lam = torch.exp(mid)
        above = torch.exp(-lam / 2) * (1 + torch.exp(-lam)) / (-torch.expm1(-lam)) ** 2 > ms
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return codes, torch.exp((lo + hi) / 2)


def conditional_mean(q: torch.Tensor) -> torch.Tensor:
    """Integers (rows, cols) -> values in steps at each bin's conditional mean (Laplacian per channel)."""
    codes, lam = _channel_rates(q)
    delta = torch.where(codes > 0, -0.5 + 1 / lam - 1 / torch.expm1(lam), torch.zeros_like(lam))
    return q + torch.sign(q) * delta


def energy_kept(q: torch.Tensor) -> torch.Tensor:
    """Integers -> values in steps scaled per channel by E[x²] / E[x·q] under the same Laplacian."""
    codes, lam = _channel_rates(q)
    lam = lam[:, None]
    k = torch.arange(1, 4000, dtype=torch.float64)[None]
    a, b = k - 0.5, k + 0.5
    exq = (k * ((a + 1 / lam) * torch.exp(-lam * a) - (b + 1 / lam) * torch.exp(-lam * b))).sum(1)
    gain = (2 / lam[:, 0] ** 2) / exq.clamp_min(1e-30)
    return q * torch.where(codes > 0, gain, torch.ones_like(gain))


RECONSTRUCTIONS = {"bin centre (shipped)": None, "conditional mean": conditional_mean, "energy kept": energy_kept}


def _rebuilt(how):
    """payload.decode with transform-coded sections rebuilt by ``how`` (their noise left as decoded)."""
    decode = payload.decode

    def run(blob: bytes):
        msg = decode(blob)
        for s in msg.sections:
            if s.bits == 0 and how is not None:
                s.data = (how(torch.round(s.data.double() / s.step)) * s.step).float()
        return msg
    return run


def _kls(pair, calib, cases, plan) -> list[float]:
    """KL per prompt of ``plan``, measured as the bench measures it."""
    return measure.run_plan_on_cases(pair, cases, plan, calib).kl_per_prompt


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _versus(label: str, raw: list[float], got: list[float]) -> str:
    boot = metrics.paired_bootstrap(raw, got)
    return f"{label} {_mean(got):.4f} = {boot['ratio']:.3f}x raw [{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]"


def value_error(calib, states: list, name: str) -> None:
    """Squared error of the coded values per reconstruction, relative to the bin centre's, summed over
    sections with the equal-slope weights (1 / relative step², so every section counts as its
    predicted KL does), on the transform-coded payloads of the producer prefills ``states`` at each budget."""
    for budget in BUDGETS:
        plan = plans.tc_plan(calib, budget)
        rel = {(i, kind): s for kind, steps in (("k_code", plan.steps_k), ("v_code", plan.steps_v))
               for i, s in enumerate(steps)}
        err = dict.fromkeys(RECONSTRUCTIONS, 0.0)
        for st in states:
            for s in payload.decode(transfer.build_payload(st, plan, calib)).sections:
                if s.bits != 0:
                    continue
                code, rows = (calib.key_codes, st.keys_pre) if s.kind == "k_code" else (calib.value_codes, st.values)
                z = code[s.layer].encode(rows[s.layer][1:], code[s.layer].max_rank).double()  # token 0 is recomputed
                q = torch.round(s.data.double() / s.step)
                for label, how in RECONSTRUCTIONS.items():
                    got = q if how is None else how(q)
                    err[label] += float(((z[:, : q.shape[1]] - got * s.step) ** 2).sum()
                                        + (z[:, q.shape[1]:] ** 2).sum()) / rel[s.layer, s.kind] ** 2
        cells = ", ".join(f"{label} {e / err['bin centre (shipped)']:.3f}" for label, e in err.items())
        print(f"value error {name:10s} @{budget} B/token, weighted squared error vs bin centre: {cells} "
              f"({len(states)} selection windows)", flush=True)


def _fp16_plan(calib):
    """The full-rank codes sent in fp16: nothing lost to quantisation."""
    return plans.scd_plan(*plans.full_ranks(calib), code_bits=16, name="fp16")


def floor_and_quantiser(pair, calib, name: str) -> None:
    select = calibration.windows(pair, calib.config)[2]
    cases = measure.prepare_cases(pair, select, calib.config.cont_len, progress=False)
    value_error(calib, [c.state for c in cases], name)
    raw = _kls(pair, calib, cases, plans.raw_plan(calib.n_layers))
    fp16 = _kls(pair, calib, cases, _fp16_plan(calib))
    print(f"floor       {name:10s} raw KL {_mean(raw):.4f}; {_versus('full-rank codes in fp16', raw, fp16)} "
          f"({len(cases)} selection windows)", flush=True)
    original = payload.decode
    try:
        for budget in BUDGETS:
            plan = plans.tc_plan(calib, budget)
            base = None
            for label, how in RECONSTRUCTIONS.items():
                payload.decode = _rebuilt(how)
                got = _kls(pair, calib, cases, plan)  # the same windows, the same payloads, rebuilt another way
                base = base or got
                vs = metrics.paired_bootstrap(base, got)
                print(f"quantiser   {name:10s} @{budget} B/token {label:22s} KL {_mean(got):.4f} "
                      f"({_mean(got) / _mean(raw):.3f}x raw), "
                      f"vs bin centre {vs['ratio']:.3f} [{vs['ratio_ci'][0]:.3f}, {vs['ratio_ci'][1]:.3f}]", flush=True)
    finally:
        payload.decode = original


def eval_floor(pair, calib, name: str) -> None:
    corpus = builtin.training_corpus(name)
    cfg = bench.ScdBenchConfig()  # the bench's defaults: 16 prompts of 256 + 32 tokens
    cases = measure.prepare_cases(pair, [w.ids for w in bench.eval_windows(None, cfg, pair, corpus)], cfg.cont_len,
                                   progress=False)
    raw = _kls(pair, calib, cases, plans.raw_plan(calib.n_layers))
    rows = [("full-rank codes in fp16", _fp16_plan(calib)),
            ("full-rank codes in int4", plans.full_rank_plan(calib))]
    rows += [(f"transform coded @{b}", plans.tc_plan(calib, b)) for b in BUDGETS]
    cells = "; ".join(_versus(label, raw, _kls(pair, calib, cases, plan)) for label, plan in rows)
    print(f"eval floor  {name:10s} raw KL {_mean(raw):.4f}; {cells} ({len(cases)} eval prompts of {corpus})",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.scd_floor_check", description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="SPECIALIST",
                    help=f"built-in specialists to check (default: every one: {', '.join(builtin.specialists())})")
    ap.add_argument("--eval", action="store_true", help="part 3 only: the floor on the specialist's eval split")
    ap.add_argument("--error", action="store_true", help="part 2's squared errors only (no KL run)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.names) - set(builtin.specialists()))
    if unknown:
        ap.error(f"no built-in specialist named {', '.join(unknown)}; built in: {', '.join(builtin.specialists())}")
    for name in args.names or builtin.specialists():
        pair = load_pair("builtin:smollm2-135m", f"builtin:{name}")
        calib = calibration.Calibration.load(calibration.shipped_folder(f"builtin:{name}"), pair)
        if args.eval:
            eval_floor(pair, calib, name)
            continue
        if args.error:
            prefixes = [data.split_prompt(w, calib.config.cont_len)[0]
                        for w in calibration.windows(pair, calib.config)[2]]
            value_error(calib, [transfer.producer_state(pair.producer, p) for p in prefixes], name)
            continue
        more_input(pair, calib, name)
        floor_and_quantiser(pair, calib, name)


if __name__ == "__main__":
    main()
