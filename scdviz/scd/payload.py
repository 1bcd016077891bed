"""The SCD wire format: one self-describing byte string per transferred prompt.

Layout (little endian):

  header   magic b"SCD3" | n_tokens u32 | token0 u32 | n_sections u16 | sink u8 |
           calibration u64 | n_layers u16 | n_tail u16 | n_layers mode bytes |
           n_tail token ids u32                              (27 + n_layers + 4 n_tail bytes)
  section  layer u16 | kind u8 | bits u8 | axis u8 | group u16 | rows u32 | cols u16  (13 bytes)
           then the body:
             bits 16:   rows*cols fp16 values, row-major
             bits 8, 4, 3, 2: ceil(rows*cols*bits/8) packed integers (scdviz.scd.quant),
                        then n_groups fp16 minima, then n_groups fp16 steps
             an empty matrix (a rank-0 code) has no body
           axis byte | 0x80: the integers are entropy coded (scdviz.scd.entropy: its body
           replaces the packed integers; minima and steps follow as above)
             bits 0:    transform coded (scdviz.scd.entropy): one uniform step for the whole
                        matrix, each channel's integers rANS-coded under a Gaussian; cols is
                        the channels sent (the trailing all-zero ones are dropped)

The header makes a message decodable alone: ``sink`` says how token 0 is handled (SINKS:
0 sent like any token, 1 left out of every section and recomputed by the consumer),
``calibration`` names the calibration whose codes it holds (``Calibration.tag``, 0 for a
message without codes), and the mode bytes say what the consumer does at each layer
(MODES: raw, code, patch, recompute; a run of recompute layers starts at its "resid"
section); the tail ids are the prompt
tokens after the ``n_tokens`` the sections cover, which the consumer runs itself over the cache it
built (a recomputed tail, as CacheBlend recomputes tokens; none: ``n_tail`` 0). ``payload_len`` is this
formula for sections that are not entropy coded (a coded section is never longer; a
transform-coded one has no formula: its length is the data's); tests check it against real
messages. ``spans`` walks the section headers alone. Kinds say what a section
holds (KINDS); which rows (with or without token 0) and what the receiver does with them is
the plan's business (scdviz.scd.plan). This module only (de)serialises.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch
from torch import Tensor

from scdviz.scd import entropy, quant

MAGIC = b"SCD3"
HEADER = struct.Struct("<4sIIHBQHH")  # then one byte per layer (its mode), then the tail ids (u32)
TAIL_ID = struct.Struct("<I")
MODES = ("raw", "code", "patch", "recompute")  # a layer's mode byte is its index here
SINKS = ("send", "recompute")  # the sink byte is its index here
SECTION = struct.Struct("<HBBBHIH")
KINDS = {
    "k": 0,  # post-RoPE keys, heads flattened (rows tokens, cols Hkv*D)
    "v": 1,  # values, heads flattened
    "k_code": 2,  # REUSE code of pre-RoPE keys (cols = rank)
    "v_code": 3,  # REUSE code of values
    "h_code": 4,  # PATCH code of the normalised H_in (cols = rank_h)
    "resid": 5,  # residual stream entering a recomputed run of layers (cols = d)
    "k_recent": 6,  # KIVI's full-precision window: the last rows of post-RoPE keys of a quantised raw layer
    "v_recent": 7,  # the same for values
}
AXIS_CODES = {"token": 0, "channel": 1}
CODED = 0x80  # flag in the axis byte: entropy-coded integers


@dataclass
class Section:
    """One matrix of a payload."""

    layer: int  # decoder layer it belongs to
    kind: str  # a key of KINDS
    data: Tensor  # (rows, cols) float
    bits: int = 16  # 16 (fp16), 8 or 4
    group: int = 32  # quantisation group size (ignored at 16 bits)
    axis: str = "channel"  # quantisation grouping, see scdviz.scd.quant
    coded: bool = False  # entropy-code the integers when that makes the section smaller
    step: float = 0.0  # bits 0: the uniform quantiser's step (transform coding)
    # decoded quantised sections: (cols,) expected squared error per value (quant.error_variance)
    noise: Tensor | None = None


@dataclass
class Layout:
    """What a message says about itself, beside its sections."""

    n_tokens: int  # prompt tokens the cache covers
    token0: int  # id of the first token (the consumer recomputes the sink from it)
    modes: list[str] = field(default_factory=list)  # (L,) one of MODES per layer; empty: no plan
    sink: str = "send"  # token-0 handling, one of SINKS
    calibration: int = 0  # Calibration.tag of the codes' calibration; 0: none
    tail: list[int] = field(default_factory=list)  # ids of the prompt tokens after the cache, run by the consumer

    def header(self, n_sections: int) -> bytes:
        """The header bytes of a message with this layout."""
        return (HEADER.pack(MAGIC, self.n_tokens, self.token0, n_sections, SINKS.index(self.sink), self.calibration,
                            len(self.modes), len(self.tail)) + bytes(MODES.index(m) for m in self.modes)
                + b"".join(TAIL_ID.pack(t) for t in self.tail))


@dataclass
class Message:
    """A decoded payload."""

    layout: Layout  # tokens, token 0, modes, sink, calibration
    sections: list[Section]  # data dequantised to float32

    @property
    def n_tokens(self) -> int:
        """Prompt tokens the cache covers."""
        return self.layout.n_tokens

    @property
    def token0(self) -> int:
        """Id of the first token."""
        return self.layout.token0


def recompute_runs(modes: list[str]) -> list[tuple[int, int]]:
    """Maximal runs [start, stop) of consecutive "recompute" layers in ``modes``."""
    out: list[tuple[int, int]] = []
    for i, mode in enumerate(modes):
        if mode != "recompute":
            continue
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def section_len(rows: int, cols: int, bits: int, group: int, axis: str) -> int:
    """Bytes of one section, header included (not for transform-coded sections, bits 0)."""
    if bits == 0:
        raise ValueError("a transform-coded section's length depends on its data")
    if bits == 16:
        return SECTION.size + 2 * rows * cols
    return SECTION.size + quant.packed_len(rows * cols, bits) + 4 * quant.n_groups(rows, cols, group, axis)


def header_len(n_layers: int, tail: int = 0) -> int:
    """Bytes of a message's header for a plan of ``n_layers`` layers and a recomputed tail of ``tail`` tokens."""
    return HEADER.size + n_layers + TAIL_ID.size * tail


def payload_len(sections: list[Section], n_layers: int = 0, tail: int = 0) -> int:
    """Bytes of the message holding these sections for a plan of ``n_layers`` layers and a recomputed tail of
    ``tail`` tokens (the format's formula)."""
    return header_len(n_layers, tail) + sum(section_len(*s.data.shape, s.bits, s.group, s.axis) for s in sections)


def encode(layout: Layout, sections: list[Section]) -> bytes:
    """Serialise sections into one payload with ``layout``'s header."""
    parts = [layout.header(len(sections))]
    for s in sections:
        rows, cols = s.data.shape
        if s.bits == 0:
            step = struct.unpack("<f", struct.pack("<f", s.step))[0]  # the f32 the receiver reads
            q = entropy.quantise_uniform(s.data.detach().cpu(), step)
            parts.append(SECTION.pack(s.layer, KINDS[s.kind], 0, AXIS_CODES[s.axis], 0, rows, q.shape[1]))
            parts.append(entropy.encode_uniform(q, step))
            continue
        if s.bits == 16:
            parts.append(SECTION.pack(s.layer, KINDS[s.kind], s.bits, AXIS_CODES[s.axis], s.group, rows, cols))
            parts.append(s.data.detach().to(torch.float16).cpu().contiguous().numpy().tobytes())
            continue
        q, lo, step = quant.quantize_ints(s.data.detach().cpu(), s.bits, s.group, s.axis)
        blob = quant.pack(q, s.bits)
        coded = entropy.encode(q, s.bits, len(blob)) if s.coded else None
        axis = AXIS_CODES[s.axis] | (CODED if coded is not None else 0)
        parts.append(SECTION.pack(s.layer, KINDS[s.kind], s.bits, axis, s.group, rows, cols))
        parts += [blob if coded is None else coded, lo.numpy().tobytes(), step.numpy().tobytes()]
    return b"".join(parts)


@dataclass
class Span:
    """Where one section of a payload lies, from its header alone."""

    layer: int
    kind: str
    bits: int
    axis: str
    group: int
    rows: int
    cols: int
    coded: bool
    start: int  # first byte of the body
    end: int  # one past its last byte
    ints: int  # bytes of the integers at the start of the body (quantised sections)

    @property
    def nbytes(self) -> int:
        """Bytes of the section, its header included."""
        return SECTION.size + self.end - self.start


def layout(payload: bytes) -> tuple[Layout, int, int]:
    """(the header's layout, its section count, the header's length); ValueError on a foreign,
    older-format or truncated message."""
    if len(payload) >= 4 and payload[:3] == MAGIC[:3] and payload[:4] != MAGIC:
        raise ValueError(f"an SCD payload of format {payload[3:4].decode(errors='replace')}; this scdviz reads format "
                         f"{MAGIC[3:].decode()} (its header says how each layer was sent): encode it again")
    if len(payload) < HEADER.size or payload[:4] != MAGIC:
        raise ValueError("not an SCD payload (bad magic)")
    _, n_tokens, token0, n_sections, sink, calibration, n_layers, n_tail = HEADER.unpack_from(payload, 0)
    end = header_len(n_layers, n_tail)
    if len(payload) < end:
        raise ValueError("truncated SCD payload")
    modes = payload[HEADER.size : HEADER.size + n_layers]
    if sink >= len(SINKS) or any(m >= len(MODES) for m in modes):
        raise ValueError("damaged SCD payload header (unknown sink or layer mode)")
    tail = [TAIL_ID.unpack_from(payload, HEADER.size + n_layers + TAIL_ID.size * i)[0] for i in range(n_tail)]
    return Layout(n_tokens, token0, [MODES[m] for m in modes], SINKS[sink], calibration, tail), n_sections, end


def spans(payload: bytes) -> tuple[Layout, list[Span]]:
    """(the header's layout, the sections' spans) of a payload, without decoding any body;
    ValueError on a foreign or truncated message."""
    head, n_sections, pos = layout(payload)
    kinds = {v: k for k, v in KINDS.items()}
    axes = {v: k for k, v in AXIS_CODES.items()}
    out = []
    for _ in range(n_sections):
        if pos + SECTION.size > len(payload):
            raise ValueError("truncated SCD payload")
        layer, kind, bits, axis, group, rows, cols = SECTION.unpack_from(payload, pos)
        coded, axis = bool(axis & CODED), axes[axis & ~CODED]
        start = pos + SECTION.size
        if (bits == 0 or coded) and start + entropy.HEAD_LEN > len(payload):
            raise ValueError("truncated SCD payload")
        if bits == 0:
            ints, end = 0, start + entropy.uniform_len(payload[start : start + entropy.HEAD_LEN], cols)
        else:
            # bytes of the integers (0 at 16 bits)
            ints = _ints_len(payload[start : start + 4], rows, cols, bits, coded)
            end = start + (2 * rows * cols if bits == 16 else ints + 4 * quant.n_groups(rows, cols, group, axis))
        if end > len(payload):
            raise ValueError("truncated SCD payload")
        out.append(Span(layer, kinds[kind], bits, axis, group, rows, cols, coded, start, end, ints))
        pos = end
    return head, out


def decode(payload: bytes) -> Message:
    """Parse a payload; ValueError on a foreign or truncated message."""
    head, found = spans(payload)
    sections = []
    for sp in found:
        body = payload[sp.start : sp.end]
        if sp.bits == 0:
            data, step = entropy.decode_uniform(body, sp.rows, sp.cols)
            noise = torch.full((sp.cols,), quant.rounding_variance(step), dtype=torch.float64, device="cpu")
            sections.append(Section(sp.layer, sp.kind, data, 0, sp.group, sp.axis, step=step, noise=noise))
            continue
        n = quant.n_groups(sp.rows, sp.cols, sp.group, sp.axis) if sp.bits < 16 else 0
        data, noise = _body(body, sp.rows, sp.cols, sp.bits, sp.group, sp.axis, sp.ints, n, sp.coded)
        sections.append(Section(sp.layer, sp.kind, data, sp.bits, sp.group, sp.axis, sp.coded, noise=noise))
    return Message(head, sections)


def _ints_len(body: bytes, rows: int, cols: int, bits: int, coded: bool) -> int:
    """Bytes holding a section's integers: the coded body's length, or the packed length."""
    if bits == 16:
        return 0
    return entropy.body_len(body, bits) if coded else quant.packed_len(rows * cols, bits)


def _body(body: bytes, rows: int, cols: int, bits: int, group: int, axis: str, ints: int, n: int,
          coded: bool) -> tuple[Tensor, Tensor | None]:
    """A section's values (fp16, or integers, packed or entropy coded in ``ints`` bytes, then n minima
    and n steps) and, quantised, each column's expected squared error (None at fp16)."""
    if not rows * cols:  # an empty section (a rank-0 code): host-side like every decoded section
        return torch.zeros(rows, cols, device="cpu"), None
    if bits == 16:
        return torch.frombuffer(bytearray(body), dtype=torch.float16).float().reshape(rows, cols), None
    lo = torch.frombuffer(bytearray(body[ints : ints + 2 * n]), dtype=torch.float16)
    step = torch.frombuffer(bytearray(body[ints + 2 * n :]), dtype=torch.float16)
    q = entropy.decode(body[:ints], bits, rows * cols) if coded else quant.unpack(body[:ints], bits, rows * cols)
    return (quant.dequantize_ints(q, lo, step, (rows, cols), group, axis),
            quant.error_variance(step, (rows, cols), group, axis))
