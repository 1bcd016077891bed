"""Entropy coding of a payload section's integers (rANS, the ``constriction`` library), two ways.

Packed sections coded losslessly (``encode`` / ``decode``): the model is the section's own
histogram (order 0), sent with it: 2**bits frequencies as u16, then the rANS stream as u32
words. Layout of a coded body:

    n_words u32 | freq u16 × 2**bits | words u32 × n_words

``encode`` returns None when coding would not make the section smaller (tiny sections, flat
histograms): the payload then stores the packed integers instead, so an entropy-coded
payload is never larger than the same payload packed.

Transform coding (``quantise_uniform``, ``encode_uniform``, ``decode_uniform``, ``fit_scale``):
a code matrix quantised with one uniform step and coded under a Gaussian per channel; see the
section below.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
from torch import Tensor

_LEN = struct.Struct("<I")


def _model(freq: np.ndarray):
    import constriction  # imported here: only coded payloads need it

    return constriction.stream.model.Categorical(freq.astype(np.float64) / freq.sum(), perfect=False)


def _frequencies(q: np.ndarray, bits: int) -> np.ndarray:
    """Histogram scaled to u16; every symbol that occurs keeps a frequency of at least 1."""
    counts = np.bincount(q, minlength=2**bits).astype(np.float64)
    freq = np.round(counts * 65535 / counts.sum())
    freq[(counts > 0) & (freq == 0)] = 1
    return freq.astype(np.uint16)


def coded_len(n_words: int, bits: int) -> int:
    """Bytes of a coded body holding ``n_words`` rANS words."""
    return _LEN.size + 2 * 2**bits + 4 * n_words


def encode(q: Tensor, bits: int, limit: int) -> bytes | None:
    """Integers (n,) uint8 < 2**bits -> coded body, or None unless it is shorter than ``limit`` bytes."""
    import constriction

    if not q.numel():
        return None
    values = q.numpy()
    freq = _frequencies(values, bits)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(values.astype(np.int32), _model(freq))
    words = coder.get_compressed()
    if coded_len(len(words), bits) >= limit:
        return None
    return _LEN.pack(len(words)) + freq.tobytes() + words.astype("<u4").tobytes()


def body_len(body: bytes, bits: int) -> int:
    """Length of the coded body at the start of ``body`` (from its word count)."""
    return coded_len(_LEN.unpack_from(body, 0)[0], bits)


def decode(body: bytes, bits: int, n: int) -> Tensor:
    """Coded body -> the ``n`` integers, uint8."""
    import constriction

    n_words = _LEN.unpack_from(body, 0)[0]
    table = 2 * 2**bits
    freq = np.frombuffer(body, dtype="<u2", count=2**bits, offset=_LEN.size)
    words = np.frombuffer(body, dtype="<u4", count=n_words, offset=_LEN.size + table).astype(np.uint32)
    values = constriction.stream.stack.AnsCoder(words).decode(_model(freq), n)
    return torch.from_numpy(values.astype(np.uint8))


# ----------------------------------------------------------------------------- transform coding
#
# A transform-coded section (payload bits 0): a code matrix Z (rows tokens, cols channels) is
# quantised with one uniform step s for every channel, q = round(Z / s), and each channel's
# integers are rANS-coded under a zero-mean Gaussian quantised to unit bins whose standard
# deviation is that channel's, sent as one byte on a log scale (0: the channel is all zero and
# costs no symbol); channels sharing a scale share one model, a lookup table over ±peak (the
# section's largest |integer|) when peak ≤ TABLE_R, else a parametric one. Channels past the
# last non-zero one are not sent, so the rank follows from the step. With orthonormal decoder
# rows (REUSE codes, scdviz.scd.rrr) the squared error in K/V space is the sum over channels,
# so one step per section, scaled by the section's measured KL sensitivity, is the classic
# equal-slope allocation (reverse water-filling).
# Layout of a transform-coded body:
#
#     step f32 | n_words u32 | peak u16 | scale u8 × cols | words u32 × n_words

_TC = struct.Struct("<fIH")  # step, rANS words, largest |integer|
HEAD_LEN = max(_TC.size, _LEN.size)  # bytes that give the length of either kind of coded body
LIMIT = 2**15 - 1  # integers are clamped to ±LIMIT (the model's alphabet)
EMPTY_LEN = _TC.size  # bytes of a transform-coded body whose integers are all zero (no channel sent)


def scale_codes(q: Tensor) -> Tensor:
    """(..., rows, cols) integers -> (..., cols) uint8 log-scale code of each channel's RMS about
    the model's zero mean (0: the channel is all zero)."""
    sd = q.double().pow(2).mean(-2).sqrt().clamp_min(0.1)
    code = (torch.log2(sd) * 8).round().add(128).clamp(1, 255)
    return torch.where((q != 0).any(-2), code, torch.zeros_like(code)).to(torch.uint8)


def stds(codes: Tensor) -> Tensor:
    """(...) uint8 byte codes of ``scale_codes`` -> (...) float64 standard deviations (in steps) the
    coder uses, the same on both sides (code 0, an all-zero channel, gives 2**-16)."""
    return torch.pow(2.0, (codes.double() - 128) / 8)


def quantise_uniform(z: Tensor, step: float) -> Tensor:
    """(rows, cols) float -> integers (rows, cols_sent) int32, trailing all-zero channels dropped."""
    q = torch.round(z.double() / step).clamp(-LIMIT, LIMIT).to(torch.int32)
    live = (q != 0).any(0).nonzero()
    return q[:, : int(live.max()) + 1] if live.numel() else q[:, :0]


def _bits(q: Tensor) -> float:
    """Code length in bits of integers q (rows, cols) under the section's model."""
    codes = scale_codes(q)
    used = codes > 0
    if not used.any():
        return 0.0
    x, sd = q[:, used].abs().float(), stds(codes[used]).float()
    p = torch.special.ndtr((0.5 - x) / sd) - torch.special.ndtr((-0.5 - x) / sd)  # the lower tail: exact in fp32
    return float(-torch.log2(p.clamp_min(2.0**-24)).double().sum())


def estimated_len(q: Tensor, bits: float | None = None) -> int:
    """Bytes of the transform-coded body of integers q (rows, cols) from ``quantise_uniform``,
    from the model's code length (``bits``, else measured; the real one differs by a few words either way)."""
    bits = _bits(q) if bits is None else bits
    return _TC.size + q.shape[1] + (4 * (int(bits / 32) + 2) if bits > 0 else 0)  # no symbol: no word


TABLE_R = 1023  # up to this largest |integer| a section's models are lookup tables; beyond, parametric


def _models(used: list[int], peak: int) -> dict[int, object]:
    """The coder's model for each channel scale code in ``used``: a categorical table over
    [-peak, peak] (symbols shifted by +peak) of the Gaussian quantised to unit bins, or beyond
    TABLE_R a parametric quantised Gaussian over ±LIMIT. The same on both sides."""
    import constriction

    sd = stds(torch.tensor(used, dtype=torch.uint8, device="cpu"))
    if peak > TABLE_R:
        return {c: constriction.stream.model.QuantizedGaussian(-LIMIT, LIMIT, 0.0, float(s)) for c, s in zip(used, sd)}
    x = torch.arange(-peak, peak + 1, dtype=torch.float64, device="cpu")
    p = torch.special.ndtr((x + 0.5) / sd[:, None]) - torch.special.ndtr((x - 0.5) / sd[:, None])
    p = (p.clamp_min(1e-12) / p.clamp_min(1e-12).sum(1, keepdim=True)).numpy()
    return {c: constriction.stream.model.Categorical(row, perfect=False) for c, row in zip(used, p)}


def _groups(codes: Tensor) -> list[tuple[int, Tensor]]:
    """Channels sharing a scale code, in a fixed order: (code, channel indices)."""
    return [(int(c), (codes == c).nonzero()[:, 0]) for c in sorted({int(c) for c in codes.tolist() if c})]


def encode_uniform(q: Tensor, step: float) -> bytes:
    """Integers (rows, cols) from ``quantise_uniform`` -> transform-coded body."""
    import constriction

    codes = scale_codes(q)
    peak = int(q.abs().max()) if q.numel() else 0
    shift = 0 if peak > TABLE_R else peak
    coder = constriction.stream.stack.AnsCoder()
    groups = _groups(codes)
    if groups:
        models = _models([code for code, _ in groups], peak)
        symbols = (q[:, torch.cat([chans for _, chans in groups])].T + shift).numpy().astype(np.int32)  # group order
        starts = np.cumsum([0] + [len(chans) for _, chans in groups])
        for i in reversed(range(len(groups))):  # a stack: the decoder reads the first group first
            coder.encode_reverse(symbols[starts[i] : starts[i + 1]].reshape(-1), models[groups[i][0]])
    words = coder.get_compressed()
    return _TC.pack(step, len(words), peak) + codes.numpy().tobytes() + words.astype("<u4").tobytes()


def uniform_len(body: bytes, cols: int) -> int:
    """Length of the transform-coded body at the start of ``body``."""
    return _TC.size + cols + 4 * _TC.unpack_from(body, 0)[1]


def decode_uniform(body: bytes, rows: int, cols: int) -> tuple[Tensor, float]:
    """Transform-coded body -> (the dequantised matrix (rows, cols) float32, its step)."""
    import constriction

    step, n_words, peak = _TC.unpack_from(body, 0)
    codes = torch.tensor(list(body[_TC.size : _TC.size + cols]), dtype=torch.uint8, device="cpu")
    out = torch.zeros(rows, cols, dtype=torch.float64, device="cpu")  # payloads are host-side
    groups = _groups(codes)
    if groups:
        models = _models([code for code, _ in groups], peak)
        shift = 0 if peak > TABLE_R else peak
        words = np.frombuffer(body, dtype="<u4", count=n_words, offset=_TC.size + cols).astype(np.uint32)
        coder = constriction.stream.stack.AnsCoder(words)
        values = [coder.decode(models[code], rows * len(chans)) for code, chans in groups]
        order = torch.cat([chans for _, chans in groups])
        out[:, order] = torch.from_numpy(np.concatenate(values).astype(np.float64) - shift).reshape(len(order), rows).T
    return (out * step).float(), step


def fit_scale(codes: list[Tensor], rel_steps: list[float], allowed: int, extra: int, tol: float = 0.002,
              rows_seen: int = 128) -> float:
    """The global scale g (section i quantised with step g · rel_steps[i]) whose estimated
    transform-coded bytes, plus ``extra`` bytes per section (its header), fit ``allowed`` with
    at most ``tol`` of it left over (or the finest scale searched). The estimate codes about
    ``rows_seen`` evenly spaced rows and scales their bits to all rows (the caller checks the
    real length). Bytes fall monotonically as log g grows; the root is found by regula falsi
    (Illinois) on log g. ValueError when not even all-zero sections fit."""
    rows = max((z.shape[0] for z in codes), default=1)
    stride = max(1, rows // rows_seen)
    seen = [z[::stride] for z in codes]

    def over(log_g: float) -> int:
        total = 0
        for z, part, s in zip(codes, seen, rel_steps):
            q = quantise_uniform(part, 2**log_g * s)
            total += estimated_len(q, _bits(q) * z.shape[0] / max(part.shape[0], 1)) + extra
        return total - allowed

    top = max((float(z.abs().max()) / s for z, s in zip(codes, rel_steps) if z.numel()), default=1.0)
    hi = math.log2(max(top, 1e-30)) + 1  # every integer is 0
    lo = hi - 15.5  # the finest scale: the largest integer stays inside ±LIMIT
    f_hi, f_lo = over(hi), over(lo)
    if f_hi > 0:
        raise ValueError(f"the transform-coded sections need at least {f_hi + allowed} bytes; {allowed} allowed")
    if f_lo <= 0:
        return 2**lo
    side = 0
    for _ in range(40):
        if -f_hi <= tol * allowed:
            break
        mid = hi - f_hi * (hi - lo) / (f_hi - f_lo)  # the secant's zero (f_lo > 0 >= f_hi)
        f_mid = over(mid)
        if f_mid <= 0:
            hi, f_hi = mid, f_mid
            f_lo = f_lo / 2 if side == 1 else f_lo  # Illinois: halve the stale end
            side = 1
        else:
            lo, f_lo = mid, f_mid
            f_hi = f_hi / 2 if side == -1 else f_hi
            side = -1
    return 2**hi
