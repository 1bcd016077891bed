"""H2O, the heavy-hitter oracle: keep the tokens with the most attention accumulated over every query so far.

Based on Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (2023, arXiv:2306.14048). A token's score is the attention it has received, summed over every
query that could see it, divided by how many queries saw it (the average, as kvpress's
``ObservedAttentionPress`` does at a prefill, so that early tokens are not favoured for having been
seen longer); per KV head, the mean over its query heads.

H2O as published also reserves part of the budget for the most recent tokens; this press does not (bench evict
names its decode rows ``H2O-no-recent``). Without that window the newest token can be evicted at the cut that
follows it, and on 12 dev contexts decoding 256 tokens held at 128 this score was 3.47× the windowed
ObservedAttention's KL (``assets/policy/bench/decode_dev.json``): the recent window is the next baseline to add.

``H2OPress`` is that score as a kvpress ``ScorerPress``: at a prefill it *is* ``ObservedAttentionPress``
(the same scores). While decoding, ``scdviz.evict.decode.DecodeEvictor`` keeps, for each cached token,
the attention sum and the number of queries that saw it since the prefill, and adds every decode step's
row to both: nothing is forgotten. The evictor's other use of ``ObservedAttentionPress`` (any kvpress
scorer there) scores from the window of the last ``window`` query rows alone, divided by the visibility
a full prefill would have: a recency-biased variant, not H2O.

Needs eager attention (or ``hf.ROWS`` while decoding), like ObservedAttention; like every press here it leaves
sliding-window layers whole and refuses a model whose every layer is sliding (``scdviz.evict.windows``). This
module only names the method; the accumulation lives in the evictor, which owns per-layer state.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpress import ObservedAttentionPress
from torch import Tensor

from scdviz.evict.windows import WindowLayersKept


@dataclass
class H2OPress(WindowLayersKept, ObservedAttentionPress):
    """H2O: mean attention over every query that saw the token (prefill and, under DecodeEvictor, decode).

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context removed at a prefill (kvpress convention).
    """


def accumulated(total: Tensor, count: Tensor) -> Tensor:
    """(B, Hkv, Tk) H2O's score: the attention sum (B, Hkv, Tk) (already the mean over each KV head's query heads)
    over the number of queries that saw each token (B, Hkv, Tk)."""
    return total / count.clamp_min(1)
