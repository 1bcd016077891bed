"""Fast tier: the DistillCache presses inside kvpress's wrapper presses, as kvpress tests its own.

Every press runs as ``with press(model): model(ids, past_key_values=DynamicCache(...))`` on a
tiny random Llama. Where a wrapper should not change the policy's choice, the kept tokens
must be exactly the policy's top scores (recomputed here from an eager forward); where it
should (CriticalKV, AdaKV, Composed), the expected set is recomputed independently. The
global press keeps one token set for all layers and must refuse every wrapper that scores
layer by layer, prunes beside it or changes the ratio per layer, with a clear message.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from kvpress import (
    AdaKVPress,
    ChunkPress,
    ComposedPress,
    CriticalKVPress,
    DecodingPress,
    KeyRerotationPress,
    KnormPress,
    PerLayerCompressionPress,
)
from kvpress.attention_patch import attention_patch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from scdviz.evict import features as F
from scdviz.evict.decode import DecodeEvictor
from scdviz.evict.policy import Policy, PolicyConfig, keep_count, top_b
from scdviz.evict.press import DistillCachePress
from scdviz.models import hf

WINDOW = 16
GLOBAL_REFUSAL = "global DistillCache press"


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _policy(per_head: bool = True, seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(PolicyConfig(hidden=8, per_head=per_head, window=WINDOW)).eval()


def _head(ratio: float, seed: int = 0) -> DistillCachePress:
    return DistillCachePress(policy=_policy(True, seed), compression_ratio=ratio)


def _glob(ratio: float = 0.5) -> DistillCachePress:
    return DistillCachePress(policy=_policy(False), compression_ratio=ratio)


def _prefill(model, ids: torch.Tensor) -> DynamicCache:
    """kvpress's usage: one forward into a fresh cache (inside ``with press(model):``)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def _reference(model, ids: torch.Tensor, policy: Policy):
    """An uncompressed eager forward and the policy's per-head scores per layer [(B, Hkv, T)]."""
    with hf.eager(model):
        full = hf.forward(model, ids, attentions=True, capture={"keys_pre"})
    n_kv = hf.attn_heads(model)[1]
    with torch.no_grad():
        scores = [policy(F.prefill_layer_features(a, v, WINDOW, n_kv)) for a, v in zip(full.attn, full.values)]
    return full, scores


def _kept_positions(pruned_keys: torch.Tensor, full_keys: torch.Tensor) -> torch.Tensor:
    """Positions (B, Hkv, n), sorted, of the full cache's keys that a pruned cache holds (keys are unique)."""
    dist = (pruned_keys.unsqueeze(3) - full_keys.unsqueeze(2)).abs().amax(-1)  # (B, Hkv, n, T)
    assert torch.all(dist.min(-1).values == 0), "the pruned cache holds a key the full cache does not"
    return dist.argmin(-1).sort(-1).values


@pytest.fixture
def eager_tiny():
    model = tiny_model("llama")
    hf.set_eager(model)
    return model


def _eager_for_kvpress(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
    """Llama's eager attention with kvpress's argument order (kvpress passes ``dropout`` 6th)."""
    return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)


@pytest.fixture
def headwise_tiny():
    """A tiny Llama whose attention returns probabilities AND honours kvpress's head-wise masks.

    AdaKVPress refuses ``eager`` (kvpress patches only the registered attention functions,
    eager is not one), and the other registered ones return no probabilities, which the
    DistillCache press needs. So eager is registered again, patched, under another name.
    """
    AttentionInterface.register("eager_headwise", attention_patch(_eager_for_kvpress))
    AttentionMaskInterface.register("eager_headwise", eager_mask)
    model = tiny_model("llama")
    model.set_attn_implementation("eager_headwise")
    return model


# ----------------------------------------------------------------------------- wrappers that keep the policy's choice


def test_key_rerotation_keeps_the_top_scores_rerotated_to_new_positions(eager_tiny):
    ids, n_keep = _ids(24), 12
    press = _head(0.5)
    full, scores = _reference(eager_tiny, ids, press.policy)
    with KeyRerotationPress(press=press)(eager_tiny):
        cache = _prefill(eager_tiny, ids)
    assert hf.cache_len(cache) == [n_keep] * 3
    cos, sin = hf.rope(eager_tiny, torch.arange(n_keep).unsqueeze(0))
    for layer, (keys_pre, keys, values, s) in enumerate(zip(full.keys_pre, full.keys, full.values, scores)):
        idx = top_b(s, n_keep).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])  # policy's top, in order
        got_keys, got_values = hf.layer_kv(cache, layer)
        torch.testing.assert_close(got_values, values.gather(2, idx))
        torch.testing.assert_close(got_keys, hf.rotate(keys_pre.gather(2, idx), cos, sin), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got_keys, keys.gather(2, idx), atol=1e-3)  # really moved to positions 0..n-1


def test_per_layer_compression_keeps_each_layers_top_scores(eager_tiny):
    ids, ratios = _ids(24), [0.25, 0.5, 0.75]
    press = _head(0.0)
    full, scores = _reference(eager_tiny, ids, press.policy)
    with PerLayerCompressionPress(press=press, compression_ratios=ratios)(eager_tiny):
        cache = _prefill(eager_tiny, ids)
    assert hf.cache_len(cache) == [18, 12, 6]
    for layer, (keys, s) in enumerate(zip(full.keys, scores)):
        n_keep = keep_count(24, 1.0 - ratios[layer])
        assert torch.equal(_kept_positions(hf.layer_kv(cache, layer)[0], keys), top_b(s, n_keep))
    assert press.compression_ratio == 0.0  # the wrapper restores the press's own ratio


def test_global_press_in_per_layer_compression_with_one_ratio_keeps_one_set(eager_tiny):
    """PerLayerCompressionPress skips post_init_from_model: the press must still find the last layer."""
    ids = _ids(24)
    press = _glob(0.0)
    with PerLayerCompressionPress(press=press, compression_ratios=[0.5] * 3)(eager_tiny):
        cache = _prefill(eager_tiny, ids)
    assert hf.cache_len(cache) == [12] * 3
    full = hf.forward(eager_tiny, ids)
    kept = [_kept_positions(k, f) for k, f in zip(hf.cache_kv(cache)[0], full.keys)]
    assert all(torch.equal(k, kept[0][:, :1].expand_as(k)) for k in kept)  # one set: every head, every layer


# ----------------------------------------------------------------------------- wrappers that change it


def test_critical_kv_keeps_stage_one_and_reweights_by_the_output_projection(eager_tiny):
    ids, ratio = _ids(32), 0.5
    n_keep, stage1 = 16, 8  # int((1 - ratio) * T * first_stage_ratio)
    press = CriticalKVPress(_head(ratio))
    full, scores = _reference(eager_tiny, ids, press.press.policy)
    with press(eager_tiny):
        cache = _prefill(eager_tiny, ids)
    assert hf.cache_len(cache) == [n_keep] * 3
    n_heads, n_kv, head_dim = hf.attn_heads(eager_tiny)
    changed = False
    for layer, (keys, values, s) in enumerate(zip(full.keys, full.values, scores)):
        wo = hf.layers(eager_tiny)[layer].self_attn.o_proj.weight.T.reshape(n_heads, head_dim, -1)  # (H, D, d)
        v = values.repeat_interleave(n_heads // n_kv, dim=1)  # (B, H, T, D)
        wov = torch.einsum("bhtd,hde->bhte", v, wo).abs().sum(-1)  # ||W_o v||_1 per query head
        weighted = (s + 1e-4) * wov.view(1, n_kv, -1, 32).mean(2)
        first = s.topk(stage1, dim=-1).indices
        expected = top_b(weighted.scatter(-1, first, torch.finfo(s.dtype).max), n_keep)
        kept = _kept_positions(hf.layer_kv(cache, layer)[0], keys)
        assert torch.equal(kept, expected)
        assert all(set(f.tolist()) <= set(k.tolist()) for f, k in zip(first[0], kept[0]))  # stage 1 always kept
        changed |= not torch.equal(kept, top_b(s, n_keep))
    assert changed, "CriticalKV kept exactly the policy's top scores: the reweighting had no effect"


def test_adakv_masks_a_shared_budget_per_layer(headwise_tiny):
    ids, ratio, alpha = _ids(32), 0.5, 0.2
    n_keep, t = 16, 32
    n_safe = max(1, int(n_keep * alpha))
    press = AdaKVPress(_head(ratio, seed=3), alpha_safeguard=alpha)
    full, scores = _reference(headwise_tiny, ids, press.press.policy)
    with press(headwise_tiny):
        cache = _prefill(headwise_tiny, ids)
    assert hf.cache_len(cache) == [t] * 3  # AdaKV masks, it does not shrink the cache
    uneven = False
    for layer, s in zip(hf.layers(headwise_tiny), scores):
        b, h, pos = layer.self_attn.masked_key_indices
        masked = torch.zeros_like(s, dtype=torch.bool)
        masked[b, h, pos] = True
        kept = ~masked
        assert int(kept.sum()) == 2 * n_keep  # the layer's total budget is that of per-head top-k
        forced = s.scatter(-1, s.topk(n_safe, dim=-1).indices, float("inf"))
        expected = torch.zeros_like(kept).flatten()
        expected[forced.flatten().topk(2 * n_keep).indices] = True
        assert torch.equal(kept, expected.view_as(kept))  # safeguard, then the top scores across heads
        assert int(kept.sum(-1).min()) >= n_safe
        uneven |= kept.sum(-1).tolist() != [[n_keep, n_keep]]
    assert uneven, "AdaKV split every layer's budget evenly: the test no longer checks the reallocation"

    attn = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, i, o: attn.__setitem__(m.layer_idx, o[1]))
        for layer in hf.layers(headwise_tiny)
    ]
    try:
        with torch.no_grad():  # the next decode step must not attend to the masked keys
            headwise_tiny(ids[:, -1:], past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    for idx, layer in enumerate(hf.layers(headwise_tiny)):
        b, h, pos = layer.self_attn.masked_key_indices
        rows = attn[idx][0, :, 0, :t].view(2, 2, t)  # (Hkv, group, T) of the new query
        assert float(rows[h, :, pos].abs().max()) < 1e-6
        assert float(rows.sum(-1).min()) > 0.5


def test_adakv_refuses_stock_attention_implementations():
    """Stock kvpress cannot run the DistillCache press in AdaKV: eager is refused, the others give no probabilities."""
    ids = _ids(24)
    model = tiny_model("llama")
    hf.set_eager(model)
    with pytest.raises(AssertionError, match="eager mode not supported"), AdaKVPress(_head(0.5))(model):
        _prefill(model, ids)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match='attn_implementation="eager"'), AdaKVPress(_head(0.5))(model):
        _prefill(model, ids)


def test_composed_press_applies_the_policy_then_the_next_press(eager_tiny):
    ids = _ids(40)
    head = _head(0.5)
    full, scores = _reference(eager_tiny, ids, head.policy)
    press = ComposedPress([head, KnormPress(compression_ratio=0.5)])
    with press(eager_tiny):
        cache = _prefill(eager_tiny, ids)
    assert hf.cache_len(cache) == [10] * 3  # 40 -> 20 -> 10
    assert press.compression_ratio == pytest.approx(0.75)
    for layer, (keys, s) in enumerate(zip(full.keys, scores)):
        first = top_b(s, 20)
        norms = keys.gather(2, first.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])).norm(dim=-1)
        expected = first.gather(-1, (-norms).topk(10, dim=-1).indices).sort(-1).values
        assert torch.equal(_kept_positions(hf.layer_kv(cache, layer)[0], keys), expected)


def test_per_head_press_after_another_pruning_press_says_to_go_first(eager_tiny):
    with pytest.raises(ValueError, match="first in a ComposedPress"):
        with ComposedPress([KnormPress(compression_ratio=0.5), _head(0.5)])(eager_tiny):
            _prefill(eager_tiny, _ids(24))


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda p: KeyRerotationPress(press=p), id="key-rerotation"),
        pytest.param(lambda p: CriticalKVPress(p), id="criticalkv"),
        pytest.param(lambda p: AdaKVPress(p), id="adakv"),
        pytest.param(lambda p: ComposedPress([p, KnormPress(compression_ratio=0.5)]), id="composed-first"),
        pytest.param(lambda p: ComposedPress([KnormPress(compression_ratio=0.5), p]), id="composed-second"),
        pytest.param(lambda p: PerLayerCompressionPress(press=p, compression_ratios=[0.25, 0.5, 0.75]), id="per-layer"),
        pytest.param(lambda p: DecodingPress(base_press=p, compression_interval=1, target_size=8), id="decoding"),
    ],
)
def test_global_press_refuses_layer_by_layer_wrappers(headwise_tiny, wrap):
    ids = _ids(24)
    with pytest.raises(ValueError, match=GLOBAL_REFUSAL), wrap(_glob())(headwise_tiny):
        cache = _prefill(headwise_tiny, ids)
        with torch.no_grad():  # DecodingPress only acts on a decode step
            headwise_tiny(ids[:, -1:], past_key_values=cache)


@pytest.mark.parametrize("per_head", [True, False])
def test_chunk_press_refuses_attention_probabilities(eager_tiny, per_head):
    press = _head(0.5) if per_head else _glob()
    with pytest.raises(AssertionError, match="does not support attentions"), ChunkPress(press, 8)(eager_tiny):
        _prefill(eager_tiny, _ids(24))


# ----------------------------------------------------------------------------- decoding


def test_decoding_press_is_not_the_decode_evictor(eager_tiny):
    """Why DecodeEvictor is not built on DecodingPress (decode.py): interval semantics and scoring input."""
    prompt, budget, interval, steps = _ids(20), 8, 3, 6
    seen = []
    base = _head(0.0)
    score = base.score
    base.score = lambda m, h, k, v, a, kw: seen.append((h.shape[1], a.shape[-2])) or score(m, h, k, v, a, kw)

    def lengths(press) -> list[int]:
        out, cache = [], hf.forward(eager_tiny, prompt[:, :-1]).cache  # 19 tokens, more than the budget
        with press(eager_tiny):
            hf.generate(eager_tiny, cache, prompt[:, -1:], 19, steps, on_step=lambda c, s: out.append(hf.cache_len(c)))
        assert all(len(set(n)) == 1 for n in out)  # every layer alike
        return [n[0] for n in out]

    decoding = DecodingPress(base_press=base, compression_interval=interval, target_size=budget)
    assert lengths(decoding) == [20, 21, 8, 9, 10, 8]  # waits `interval` passes, even above the budget
    assert seen and all(row == (interval, 1) for row in seen[:3])  # 3 buffered states, ONE attention row
    evictor = DecodeEvictor(DistillCachePress(policy=_policy(True)), budget=budget, interval=interval, window=4)
    assert lengths(evictor) == [8, 9, 10, 8, 9, 10]  # cut at once, never above budget + interval - 1
    assert evictor.states[0].rows.shape[2] == 4  # scored from a window of 4 rows


def test_decode_evictor_refuses_the_global_policy(eager_tiny):
    with pytest.raises(ValueError, match="per-head policy"), DecodeEvictor(_glob(), budget=8)(eager_tiny):
        pass
