"""Group-wise asymmetric integer quantisation with real bit packing (KIVI-style axes).

A matrix X (rows = tokens, cols = channels) is cut into groups of ``group`` entries
either along the channels of each token (``axis="token"``: per-token, KIVI's choice for
values) or along the tokens of each channel (``axis="channel"``: per-channel, KIVI's
choice for keys and our choice for SCD codes, whose dimensions differ in scale). Each
group stores its minimum and step in fp16; entries become ``bits``-bit integers packed
into bytes (two per byte at 4 bits). The last group along an axis may be short.

Pure tensor maths; the byte layout of a whole message is scdviz.scd.payload.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

AXES = ("token", "channel")


def n_groups(rows: int, cols: int, group: int, axis: str) -> int:
    """How many (min, step) pairs a (rows, cols) matrix needs."""
    if axis == "token":
        return rows * math.ceil(cols / group)
    if axis == "channel":
        return cols * math.ceil(rows / group)
    raise ValueError(f"unknown quantisation axis {axis!r}; use one of {AXES}")


def packed_len(n_values: int, bits: int) -> int:
    """Bytes holding ``n_values`` integers of ``bits`` bits."""
    return math.ceil(n_values * bits / 8)


def _grouped(x: Tensor, group: int, axis: str) -> tuple[Tensor, int]:
    """(rows, cols) -> (n_groups, group) with edge padding, and the padded length of the grouped axis."""
    m = x if axis == "token" else x.T  # groups run along the last dim of m
    length = m.shape[1]
    padded = math.ceil(length / group) * group
    if padded > length:
        m = torch.cat([m, m[:, -1:].expand(-1, padded - length)], dim=1)
    return m.reshape(-1, group), padded


def quantize_ints(x: Tensor, bits: int, group: int, axis: str) -> tuple[Tensor, Tensor, Tensor]:
    """x (rows, cols) -> (integers (rows*cols,) uint8 in wire order, minima (n_groups,) fp16,
    steps (n_groups,) fp16)."""
    rows, cols = x.shape
    if not rows * cols:  # an empty section (a rank-0 code): no values, no groups
        empty = x.new_zeros(0, dtype=torch.float16)
        return x.new_zeros(0, dtype=torch.uint8), empty, empty
    g, padded = _grouped(x.float(), group, axis)
    lo = g.min(1).values.half()
    step = ((g.max(1).values - lo.float()) / (2**bits - 1)).clamp_min(1e-8).half()
    q = ((g - lo.float()[:, None]) / step.float()[:, None]).round().clamp(0, 2**bits - 1).to(torch.uint8)
    q = q.reshape(-1, padded)[:, : (cols if axis == "token" else rows)]  # drop padding
    return q.reshape(-1), lo, step


def quantize(x: Tensor, bits: int, group: int, axis: str) -> tuple[bytes, Tensor, Tensor]:
    """x (rows, cols) -> (packed codes, minima (n_groups,) fp16, steps (n_groups,) fp16)."""
    q, lo, step = quantize_ints(x, bits, group, axis)
    return pack(q, bits), lo, step


def dequantize(blob: bytes, lo: Tensor, step: Tensor, shape: tuple[int, int], bits: int, group: int,
               axis: str) -> Tensor:
    """Inverse of ``quantize`` up to rounding: (rows, cols) float32."""
    return dequantize_ints(unpack(blob, bits, shape[0] * shape[1]), lo, step, shape, group, axis)


def dequantize_ints(q: Tensor, lo: Tensor, step: Tensor, shape: tuple[int, int], group: int, axis: str) -> Tensor:
    """Integers in wire order (``quantize_ints``) -> (rows, cols) float32."""
    rows, cols = shape
    if not rows * cols:
        return lo.new_zeros(rows, cols, dtype=torch.float32)
    length = cols if axis == "token" else rows
    q = q.reshape(-1, length).float()
    padded = math.ceil(length / group) * group
    q = torch.cat([q, q.new_zeros(q.shape[0], padded - length)], dim=1).reshape(-1, group)
    m = (q * step.float()[:, None] + lo.float()[:, None]).reshape(-1, padded)[:, :length]
    return m if axis == "token" else m.T.contiguous()


def rounding_variance(step):
    """Expected squared error of rounding to a grid of ``step`` (uniform-error model): step²/12."""
    return step**2 / 12


def error_variance(step: Tensor, shape: tuple[int, int], group: int, axis: str) -> Tensor:
    """(cols,) expected squared rounding error of each column's values, step²/12 per value (the
    uniform-error model) averaged over the column's rows: what a receiver knows of its noise."""
    rows, cols = shape
    s2 = rounding_variance(step.double())
    if axis == "token":
        return s2.reshape(rows, -1).mean(0).repeat_interleave(group)[:cols]
    return s2.reshape(cols, -1).repeat_interleave(group, dim=1)[:, :rows].mean(1)


BITS = (2, 3, 4, 8)  # integer widths the packer writes (16 = fp16 is the payload's business)


def pack(q: Tensor, bits: int) -> bytes:
    """uint8 values < 2**bits -> bytes: each value's bits least significant first, values back to
    back (bits 8: the bytes as is; bits 4: low nibble first; bits 2: four per byte; bits 3: eight
    values in three bytes)."""
    if bits not in BITS:
        raise ValueError(f"unsupported bit width {bits}; use one of {BITS} (or fp16 without quantisation)")
    if bits == 8:
        return q.numpy().tobytes()
    v = q.numpy().astype(np.uint32)
    per = 8 if bits == 3 else 8 // bits  # values per block of ``bits`` bytes (3 bits) or per byte
    n = len(v)
    v = np.concatenate([v, np.zeros(-n % per, dtype=np.uint32)]).reshape(-1, per)
    word = (v << (bits * np.arange(per, dtype=np.uint32))).sum(1, dtype=np.uint32)  # one block per row
    width = bits if bits == 3 else 1  # bytes per block
    out = word.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :width].reshape(-1)
    return out[: -(-n * bits // 8)].tobytes()


def unpack(blob: bytes, bits: int, n: int) -> Tensor:
    raw = np.frombuffer(blob, dtype=np.uint8)
    if bits == 8:
        return torch.from_numpy(raw[:n].copy())
    per = 8 if bits == 3 else 8 // bits
    width = bits if bits == 3 else 1
    blocks = -(-n // per)
    padded = np.zeros(blocks * width, dtype=np.uint8)
    padded[: min(len(raw), blocks * width)] = raw[: blocks * width]
    word = np.zeros((blocks, 4), dtype=np.uint8)
    word[:, :width] = padded.reshape(blocks, width)
    word = word.reshape(-1).view("<u4").astype(np.uint32)
    values = (word[:, None] >> (bits * np.arange(per, dtype=np.uint32))) & (2**bits - 1)
    return torch.from_numpy(values.reshape(-1)[:n].astype(np.uint8))
