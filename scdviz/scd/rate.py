"""Rate–distortion curves of a calibration: what each byte of an SCD payload buys.

For every layer, and for keys and values separately, the relative error of the consumer's
K (pre-RoPE) or V rebuilt from the REUSE code at every rank 0..r_max and every code
precision (2, 3, 4, 8 bits, fp16), quantised exactly as the payload does (per-channel groups
of ``group`` tokens within each message); for every patch layer of the calibration's order
the error of the K, V the consumer regenerates from a quantised PATCH code; and per layer a
measured sensitivity: the KL(oracle ‖ consumer) per unit of relative error when that one
layer's keys (or values) of the consumer's own cache are replaced by the calibration's
reconstruction. ``scdviz.scd.plan.rd_plan`` turns these into a plan for a byte budget,
minimising Σ sensitivity × error (an additive first-order model of the KL).

Errors are relative to the consumer's centred energy of that layer's K or V (token 0
excluded: the consumer recomputes it). RoPE is a rotation per position, so key errors are
the same before and after it.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from scdviz import metrics
from scdviz.models import hf
from scdviz.progress import Reporter, steps
from scdviz.scd import calibration, quant, transfer
from scdviz.scd import plan as plans
from scdviz.scd.calibration import RateCurves

MEASURED_BITS = plans.PAYLOAD_BITS  # the precisions the rate curves measure: every one a code can travel at
HOST64 = dict(dtype=torch.float64, device=hf.HOST)  # curves are host-side statistics, like the codes


def quantised(z: Tensor, bits: int, group: int) -> Tensor:
    """z as the receiver decodes it: fp16, or ``bits``-bit per-channel groups."""
    if bits == 16:
        return z.half().float()
    return quant.dequantize(*quant.quantize(z, bits, group, "channel"), tuple(z.shape), bits, group, "channel")


def error_by_rank(code, xs: list[Tensor], ys: list[Tensor], bits: int, group: int) -> Tensor:
    """(r_max + 1,) Σ‖Y − decode(quantised code of rank r)‖² over windows, every rank at once.

    xs, ys: per window the producer's and consumer's rows. Per-channel quantisation treats
    each code dimension alone, so the rank-r code is the first r columns of the quantised
    full-rank code; with E = Y − μ_out, Z the quantised code and D the decoder,
    ‖E − Z_r D_r‖² = ‖E‖² − 2 Σ_{j<r} z_jᵀ E d_j + Σ_{j,k<r} (ZᵀZ)_jk (DDᵀ)_jk.
    """
    dec = code.dec.double()
    r_max = dec.shape[0]
    energy, cross, gram = 0.0, torch.zeros(r_max, **HOST64), torch.zeros(r_max, r_max, **HOST64)
    for x, y in zip(xs, ys):
        z = quantised(code.encode(x, r_max), bits, group).double()
        e = y.double() - code.mu_out.double()
        energy += float((e**2).sum())
        cross += (z * (e @ dec.T)).sum(0)
        gram += z.T @ z
    block = (gram * (dec @ dec.T)).cumsum(0).cumsum(1).diagonal()
    zero = torch.zeros(1, **HOST64)
    return energy - 2 * torch.cat([zero, cross.cumsum(0)]) + torch.cat([zero, block])


def _centred_energy(ys: list[Tensor]) -> float:
    y = torch.cat(ys).double()
    return float(((y - y.mean(0)) ** 2).sum().clamp_min(1e-30))


def calibration_windows(pair, calib, n_windows: int) -> list[list[int]]:
    """``n_windows`` of the calibration's selection windows (its text, never its fit windows), spread
    over its domains."""
    select = calibration.windows(pair, calib.config)[2]  # the same windows the calibration drew
    step = max(1, len(select) // max(1, n_windows))
    return select[::step][:n_windows]


def measure(pair, calib, n_windows: int = 6, progress: bool | Reporter = True) -> RateCurves:
    """Error curves and sensitivities of ``calib`` on ``n_windows`` of its calibration text."""
    t0 = time.perf_counter()
    cfg = calib.config
    n = calib.n_layers
    windows = calibration_windows(pair, calib, n_windows)
    order = [layer for layer in calib.patch_order if layer in calib.patches]
    base = plans.full_rank_plan(calib)  # the error structure the sensitivities are measured at
    rows = {key: [[] for _ in range(n)] for key in ("kp", "kc", "vp", "vc")}
    patch_sse = torch.zeros(len(order), len(MEASURED_BITS), 2, **HOST64)
    kl_k, kl_v = torch.zeros(n, **HOST64), torch.zeros(n, **HOST64)
    sse_k, sse_v = torch.zeros(n, **HOST64), torch.zeros(n, **HOST64)
    for window in steps(windows, "rate: curves and sensitivities", progress):
        case = transfer.prepare_case(pair.producer, pair.consumer, window, cfg.cont_len)
        oracle_k, oracle_v = hf.cache_kv(case.oracle_cache)
        rope = hf.Rope(pair.consumer,
                       torch.arange(case.state.ids.shape[1], device=hf.device_of(pair.consumer)).unsqueeze(0))
        for layer in range(n):  # the consumer's own rows, from the oracle's cache (pre-RoPE keys: rotated back)
            rows["kp"][layer].append(case.state.keys_pre[layer][1:])
            rows["kc"][layer].append(transfer.flat(rope.unrotate(layer, oracle_k[layer]))[1:].float().cpu())
            rows["vp"][layer].append(case.state.values[layer][1:])
            rows["vc"][layer].append(transfer.flat(oracle_v[layer])[1:].float().cpu())
        got_k, got_v = hf.cache_kv(transfer.transferred(pair.consumer, case.state, base, calib))
        start = case.state.ids.shape[1]
        for layer in range(n):
            for which, got, kl, sse in ((0, got_k, kl_k, sse_k), (1, got_v, kl_v, sse_v)):
                keys, values = list(oracle_k), list(oracle_v)
                (keys if which == 0 else values)[layer] = got[layer]
                logits, _ = transfer.continuation(pair.consumer, hf.make_cache(pair.consumer, keys, values), case.fed,
                                                  start)
                kl[layer] += float(metrics.kl_per_token(case.oracle_logits, logits).mean())
                ref = (oracle_k if which == 0 else oracle_v)[layer]
                sse[layer] += float(((got[layer].float() - ref.float()) ** 2).sum())
        positions = torch.arange(1, start, device=hf.device_of(pair.consumer)).unsqueeze(0)
        param = next(pair.consumer.parameters())
        for p, layer in enumerate(order):
            patch = calib.patches[layer]
            z = patch.encode(case.state.h_in[layer][1:])
            for b, bits in enumerate(MEASURED_BITS):
                h = patch.decode(quantised(z, bits, cfg.code_group)).to(device=param.device, dtype=param.dtype)
                k, v = hf.kv_from_hin(pair.consumer, layer, h.unsqueeze(0), positions)
                patch_sse[p, b, 0] += float(((k.float() - oracle_k[layer][:, :, 1:].float()) ** 2).sum())
                patch_sse[p, b, 1] += float(((v.float() - oracle_v[layer][:, :, 1:].float()) ** 2).sum())
    total_k = torch.tensor([_centred_energy(rows["kc"][layer]) for layer in range(n)], **HOST64)
    total_v = torch.tensor([_centred_energy(rows["vc"][layer]) for layer in range(n)], **HOST64)
    err = {}
    for kind, codes, total in (("k", calib.key_codes, total_k), ("v", calib.value_codes, total_v)):
        xs, ys = rows[f"{kind}p"], rows[f"{kind}c"]
        err[kind] = torch.stack([
            torch.stack([error_by_rank(codes[layer], xs[layer], ys[layer], bits, cfg.code_group)
                         for bits in MEASURED_BITS]) / total[layer]
            for layer in range(n)
        ]).float()
    patch_err = patch_sse / torch.stack([total_k[order], total_v[order]], 1)[:, None, :] if order else patch_sse
    return RateCurves(
        list(MEASURED_BITS), err["k"], err["v"], order, patch_err.float(), [calib.patches[i].rank_h for i in order],
        (kl_k / len(windows) / (sse_k / total_k).clamp_min(1e-12)).float(),
        (kl_v / len(windows) / (sse_v / total_v).clamp_min(1e-12)).float(),
        cfg.code_group, len(windows), time.perf_counter() - t0,
    )
