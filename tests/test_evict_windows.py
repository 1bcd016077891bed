"""Fast tier: eviction on models with sliding-window layers (scdviz.evict.windows) and kvpress presses refused on
families whose attention they would rebuild wrongly (scdviz.evict.kvpress_limits), on tiny random models of
tests/families.py. What every entry point does per family is tests/test_families.py's; this file checks the
numbers: a pruned cache of a windowed model attends exactly as the model would with the evicted keys masked, the
global press's one set, the counts and bytes reported."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, WINDOW
from kvpress import ExpectedAttentionPress, KnormPress, SnapKVPress

from scdviz.evict import bench, kvpress_limits, train, windows
from scdviz.evict.context import observe, prune
from scdviz.evict.policy import Policy, PolicyConfig, keep_count
from scdviz.evict.press import DistillCachePress
from scdviz.evict.student import Student, StudentPress
from scdviz.models import hf

T = 40  # context tokens: longer than the window (16)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _eager(name: str):
    model = FAMILIES[name](0)
    model.set_attn_implementation("eager")
    return model


def test_the_layers_compressed_and_the_refusal_of_a_model_of_sliding_layers_only():
    assert windows.compressed_layers(_eager("gemma2")) == [1, 3]
    assert windows.window_layers(_eager("gemma3")) == [0, 1, 3]
    assert windows.counted(_eager("llama3")) == "per layer and KV head"
    assert "per full-attention layer" in windows.counted(_eager("gemma2"))
    with pytest.raises(ValueError, match=f"every layer .* {WINDOW}-token sliding window"):
        windows.compressed_layers(_eager("mistral-v0.1"))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_pruned_cache_attends_as_the_model_with_the_evicted_keys_masked(name):
    """Full-attention layers keep one set, window layers everything: the continuation's logits equal the whole
    sequence's with the evicted keys masked in the full layers (and the window in the sliding ones)."""
    model = _eager(name)
    ids = _ids(T + 3)
    obs = observe(model, ids[:, :T], 8)
    kept = torch.randperm(T, generator=torch.Generator().manual_seed(0))[:12].sort().values.view(1, 12)
    cache = prune(model, obs, kept)
    assert hf.cache_len(cache) == [T if hf.family(model).sliding(i) else 12 for i in range(4)]
    got = hf.continue_logits(model, cache, ids[:, T:], T)[0]
    n = T + 3
    q, k = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    full = k <= q
    evicted = torch.ones(n, dtype=torch.bool)
    evicted[kept[0]] = False
    evicted[T:] = False
    full[T:, evicted] = False  # the continuation alone sees the pruned cache
    window = (k <= q) & (k > q - WINDOW)

    def additive(mask):
        return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]

    with torch.no_grad():
        want = model(input_ids=ids, position_ids=torch.arange(n)[None],
                     attention_mask={"full_attention": additive(full), "sliding_attention": additive(window)}
                     ).logits[0, T:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_global_press_keeps_one_set_in_the_full_layers_when_the_last_layer_slides():
    model = _eager("gemma3")  # layers: sliding, sliding, full, sliding
    ids = _ids(T)
    torch.manual_seed(0)
    press = DistillCachePress.keeping(Policy(PolicyConfig(per_head=False, window=8)).eval(), 0.25)
    full = hf.forward(model, ids)
    with press(model):
        pruned = hf.forward(model, ids)
    assert hf.cache_len(pruned.cache) == [T, T, keep_count(T, 0.25), T]
    for layer in (0, 1, 3):
        assert torch.equal(pruned.keys[layer], full.keys[layer])
    obs = observe(model, ids, 8)  # the global features average the full-attention layers only
    idx = press.policy(obs.global_features).topk(keep_count(T, 0.25), dim=-1).indices.sort(-1).values
    torch.testing.assert_close(pruned.keys[2], full.keys[2][:, :, idx[0]])


def test_observe_scores_no_window_layer_and_train_rows_are_the_full_layers():
    model = _eager("gemma2")
    obs = observe(model, _ids(T), 8, {"Knorm": KnormPress()}, (0.5,))
    assert obs.window_layers == (0, 2) and [s is None for s in obs.scores[("Knorm", 0.5)]] == [True, False] * 2
    policy = Policy(PolicyConfig(per_head=True, window=8)).eval()
    rows = train.rows(policy, obs)
    assert rows.shape == (2 * 2, T)  # 2 full layers x 2 KV heads
    for given in (rows, torch.cat([rows[:2], rows[:2], rows[2:], rows[2:]])):  # full layers' rows, or every layer's
        idx = train.indices_from_rows(given.topk(5, dim=-1).indices, obs, True)
        assert [i is None for i in idx] == [True, False, True, False] and idx[1].shape == (1, 2, 5)


def test_kvpress_presses_that_rebuild_attention_are_refused_by_what_the_family_has():
    llama, gemma3, phi4 = _eager("llama3"), _eager("gemma3"), _eager("phi4-mini")
    assert kvpress_limits.limits(llama) == [] and kvpress_limits.refusal(ExpectedAttentionPress(), llama, True) is None
    assert "RoPE per layer type" in kvpress_limits.refusal(ExpectedAttentionPress(), gemma3, True)
    assert "partial rotary" in kvpress_limits.refusal(ExpectedAttentionPress(), phi4, True)
    assert kvpress_limits.refusal(SnapKVPress(), phi4, eager=True) is None  # it reads eager's probabilities
    assert "SDPA" in kvpress_limits.refusal(SnapKVPress(), phi4, eager=False)
    assert kvpress_limits.refusal(KnormPress(), phi4, eager=False) is None
    assert "softcapping" in " ".join(kvpress_limits.limits(_eager("gemma2")))
    assert "NoPE" in " ".join(kvpress_limits.limits(_eager("smollm3")))
    assert "q-norm" in " ".join(kvpress_limits.limits(_eager("olmo2")))
    assert "scaling" in " ".join(kvpress_limits.limits(_eager("granite")))
    obs = observe(gemma3, _ids(T), 8, {"ExpectedAttention": ExpectedAttentionPress()}, (0.5,), failed := {})
    assert not obs.scores and "RoPE per layer type" in failed["ExpectedAttention"]


def test_a_student_of_other_shapes_is_refused_in_one_line_naming_both_wherever_it_scores():
    model = _eager("gemma2")
    other = Student.for_model(_eager("phi4-mini"))
    failed = {}
    assert bench.fitting_students({"s": other}, model, failed) == {}
    assert failed["s"].count("\n") == 0 and "4 layers, 2 KV heads and width 64" in failed["s"] \
        and "4, 2 and 32" in failed["s"]
    observe(model, _ids(T), 8, {"s": StudentPress(student=other)}, (0.5,), failed := {})
    assert "width 64" in failed["s"]  # scored without post_init_from_model: the same line, not a matmul error


def test_records_of_a_windowed_model_say_what_they_count_and_the_bytes_it_holds():
    model = _eager("gemma2")
    per_ctx = [{("A", "0.25"): {"kl": 0.1, "top1": 0.5, "nll": [1.0], "tokens_kept": 8,
                               **bench.window_held(model, T)}}]
    [row] = bench.aggregate(per_ctx, model, "tiny", "agnostic", {"A"})
    _, n_kv, head_dim = hf.attn_heads(model)
    assert row["cache_bytes"] == (8 * 2 + WINDOW * 2) * n_kv * head_dim * 2 * 2  # 2 full layers, 2 window layers
    assert row["tokens_kept_in"].startswith("per full-attention layer")
    [plain] = bench.aggregate([{("A", "0.25"): {"kl": 0.1, "top1": 0.5, "nll": [1.0], "tokens_kept": 8}}],
                              _eager("llama3"), "tiny", "agnostic", {"A"})
    assert "tokens_kept_in" not in plain and plain["cache_bytes"] == 8 * 4 * n_kv * head_dim * 2 * 2
