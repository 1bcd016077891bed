"""Fast tier: decode-time H2O accumulates over every query; the evictor never changes the press it is given."""

from __future__ import annotations

import torch
from conftest import tiny_model
from kvpress import KnormPress, ObservedAttentionPress, StreamingLLMPress

from scdviz.evict.decode import DecodeEvictor
from scdviz.evict.h2o import H2OPress
from scdviz.models import hf


def _eager(seed: int = 0):
    model = tiny_model("llama", seed=seed)
    hf.set_eager(model)
    return model


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(3))


def _observed_scores(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """kvpress's ObservedAttention score (mean attention over every query that sees a token, per KV head) of each
    layer after one eager pass over ``ids``."""
    trace = hf.forward(model, ids, attentions=True)
    press = ObservedAttentionPress()
    return [press.score(None, None, k, None, a, {}) for k, a in zip(trace.keys, trace.attn, strict=False)]


def test_decode_time_h2o_keeps_the_top_mean_attention_over_every_query_so_far():
    """Prefill 11 tokens, decode with the cache held at 13: the first cut comes at 14 tokens, before anything was
    evicted, so H2O's kept set must be exactly the top 13 of ObservedAttention over the whole 14-token sequence
    (all 14 queries, the prefill's and the decode steps' alike), carried on from the prefill's scores."""
    model = _eager()
    prompt, budget = _ids(12), 13
    prefill = prompt[:, :-1]
    cache = hf.forward(model, prefill).cache
    positions = [torch.arange(11).view(1, 1, 11).expand(1, k.shape[1], 11) for k in hf.cache_kv(cache)[0]]
    evictor = DecodeEvictor(H2OPress(), budget=budget, prefill_positions=positions,
                            prefill_scores=_observed_scores(model, prefill))
    with evictor(model):
        out = hf.generate(model, cache, prompt[:, -1:], 11, 3)
    assert evictor.evictions == len(positions)  # one cut per layer, at the third step
    whole = torch.cat([prompt, torch.tensor([out[:2]])], 1)  # the 14 tokens the cut saw
    for layer, scores in enumerate(_observed_scores(model, whole)):
        want = scores.topk(budget, dim=-1).indices.sort(-1).values
        assert torch.equal(evictor.states[layer].positions, want), layer
        torch.testing.assert_close(evictor.states[layer].count, (14 - want).float())  # every query that saw it


def test_decode_time_h2o_from_an_evicted_prefill_needs_its_scores():
    model = _eager()
    cache = hf.forward(model, _ids(8)).cache
    import pytest

    with pytest.raises(ValueError, match="carries each token's attention from the prefill"), \
            DecodeEvictor(H2OPress(), budget=4)(model):
        hf.generate(model, cache, _ids(1), 8, 2)


def test_the_evictor_never_changes_the_press_it_is_given():
    """A press shared with a prefill (bench cost times the same object) keeps its compression ratio: the evictor
    sets the ratio on its own copy at every cut."""
    model = _eager()
    for press in (KnormPress(compression_ratio=0.0), StreamingLLMPress(compression_ratio=0.5),
                  ObservedAttentionPress(compression_ratio=0.25)):
        before = press.compression_ratio
        cache = hf.forward(model, _ids(10)).cache
        evictor = DecodeEvictor(press, budget=4, window=4)
        with evictor(model):
            hf.generate(model, cache, _ids(1), 10, 3)
        assert evictor.evictions > 0 and press.compression_ratio == before
