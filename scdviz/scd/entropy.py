"""Entropy coding of a section's quantised integers (rANS, the ``constriction`` library).

The model is the section's own histogram (order 0), sent with it: 2**bits frequencies as
u16, then the rANS stream as u32 words. Layout of a coded body:

    n_words u32 | freq u16 × 2**bits | words u32 × n_words

``encode`` returns None when coding would not make the section smaller (tiny sections, flat
histograms): the payload then stores the packed integers instead, so an entropy-coded
payload is never larger than the same payload packed.
"""

from __future__ import annotations

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
