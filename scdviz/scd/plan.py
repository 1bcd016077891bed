"""A transfer plan: per layer, what the producer sends and what the consumer does with it.

Layer modes:
  raw        producer's post-RoPE K and V, at ``raw_bits`` (16 = fp16; 4 or 8 = KIVI-style
             group-wise: keys per-channel, values per-token)
  code       REUSE: rank-r codes of pre-RoPE K and of V (scdviz.scd.rrr), at ``code_bits``
  patch      PATCH: a code of the normalised H_in; the consumer aligns it to its own H_in
             and regenerates K, V with its own projections (scdviz.scd.patch)
  recompute  DroidSpeak-style: the producer sends the residual stream entering each run
             of consecutive recompute layers; the consumer runs those layers itself
Token 0 (the attention sink): ``sink="send"`` transfers it like any token;
``sink="recompute"`` leaves it out of every K/V/code section and the consumer
recomputes its own K, V for it with a 1-token forward.

Every method (raw reuse, 4-bit KV, DroidSpeak, SCD reuse-only, SCD full) is a Plan run
by the one machinery in scdviz.scd.transfer. This module holds no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("raw", "code", "patch", "recompute")
SINKS = ("send", "recompute")


@dataclass
class Plan:
    """Per-layer transfer decisions for one method."""

    name: str  # method label used in results
    modes: list[str]  # (L,) one of MODES per layer
    rank_k: list[int] = field(default_factory=list)  # (L,) key code rank per layer ("code" layers)
    rank_v: list[int] = field(default_factory=list)  # (L,) value code rank per layer ("code" layers)
    raw_bits: int = 16  # bits of raw K/V sections
    raw_group: int = 32  # group size of quantised raw K/V
    code_bits: int = 16  # bits of REUSE and PATCH code sections
    code_group: int = 64  # group size (tokens per channel group) of quantised codes
    sink: str = "send"  # token-0 handling, one of SINKS

    def __post_init__(self) -> None:
        bad = sorted(set(self.modes) - set(MODES))
        if bad:
            raise ValueError(f"unknown layer mode(s) {bad}; use {MODES}")
        if self.sink not in SINKS:
            raise ValueError(f"unknown sink handling {self.sink!r}; use {SINKS}")
        if "code" in self.modes and (len(self.rank_k) != len(self.modes) or len(self.rank_v) != len(self.modes)):
            raise ValueError("a plan with 'code' layers needs rank_k and rank_v for every layer")

    def layers_in(self, mode: str) -> list[int]:
        """Indices of the layers in ``mode``."""
        return [i for i, m in enumerate(self.modes) if m == mode]

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs [start, stop) of consecutive recompute layers."""
        out: list[tuple[int, int]] = []
        for i in self.layers_in("recompute"):
            if out and out[-1][1] == i:
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
        return out


def raw_plan(n_layers: int, bits: int = 16, group: int = 32, sink: str = "send") -> Plan:
    """Reuse the producer's KV as is (bits 16) or quantised KIVI-style (bits 4/8)."""
    name = "raw KV" if bits == 16 else f"{bits}-bit KV"
    return Plan(name, ["raw"] * n_layers, raw_bits=bits, raw_group=group, sink=sink)


def droidspeak_plan(n_layers: int, recompute: list[int], sink: str = "send") -> Plan:
    """Raw KV everywhere except ``recompute`` layers, which the consumer recomputes."""
    modes = ["recompute" if i in set(recompute) else "raw" for i in range(n_layers)]
    return Plan("DroidSpeak recompute", modes, sink=sink)


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
