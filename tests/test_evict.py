"""Fast tier: DistillCache maths, features, press and decode-time eviction on tiny models."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from conftest import tiny_model
from kvpress import KnormPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress
from transformers import DynamicCache

from scdviz.evict import features as F
from scdviz.evict.context import observe, prune
from scdviz.evict.decode import DecodeEvictor
from scdviz.evict.policy import Policy, PolicyConfig, compression_ratio, keep_count, standardise, top_b
from scdviz.evict.press import DistillCachePress
from scdviz.evict.train import (
    Sample,
    TrainConfig,
    gumbel_top_b,
    loo_baseline,
    plackett_luce_logprob,
    reinforce_loss,
    reinforce_step,
    warm_start,
)
from scdviz.models import hf


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _policy(per_head: bool = True, seed: int = 0, window: int = 16) -> Policy:
    torch.manual_seed(seed)
    return Policy(PolicyConfig(hidden=8, per_head=per_head, window=window)).eval()


@pytest.fixture
def eager_tiny():
    model = tiny_model("llama")
    hf.set_eager(model)
    return model


# ----------------------------------------------------------------------------- estimator maths


def _brute_force_logprob(scores: list[float], ranking: tuple[int, ...]) -> float:
    remaining, logp = list(range(len(scores))), 0.0
    for i in ranking:
        logp += scores[i] - math.log(sum(math.exp(scores[j]) for j in remaining))
        remaining.remove(i)
    return logp


@pytest.mark.parametrize("n_keep", [1, 2, 4])
def test_plackett_luce_logprob_equals_enumeration(n_keep):
    scores = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=torch.float64)
    rankings = list(itertools.permutations(range(4), n_keep))
    got = plackett_luce_logprob(scores.expand(len(rankings), -1), torch.tensor(rankings))
    expected = torch.tensor([_brute_force_logprob(scores.tolist(), r) for r in rankings], dtype=torch.float64)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.exp().sum(), torch.tensor(1.0, dtype=torch.float64))


def test_gumbel_top_b_samples_the_plackett_luce_first_choice():
    scores = torch.tensor([1.0, 0.0, -1.0, 2.0])
    gen = torch.Generator().manual_seed(0)
    draws = gumbel_top_b(scores.expand(20000, -1), 2, gen)[:, 0]
    freq = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.softmax(scores, 0), atol=0.015, rtol=0)


def test_loo_baseline_is_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    torch.testing.assert_close(loo_baseline(rewards), torch.tensor([11 / 3, 10 / 3, 3.0, 2.0]))
    with pytest.raises(ValueError, match="at least 2"):
        loo_baseline(torch.tensor([1.0]))


def _subset_prob(scores: torch.Tensor, subset: set[int], n_keep: int) -> float:
    total = 0.0
    for r in itertools.permutations(range(scores.numel()), n_keep):
        if set(r) == subset:
            total += math.exp(_brute_force_logprob(scores.tolist(), r))
    return total


def test_one_reinforce_step_raises_the_better_subset():
    scores = torch.zeros(1, 5, requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    rankings = torch.stack([gumbel_top_b(scores, 2, gen) for _ in range(16)])  # (M, 1, 2)
    rewards = torch.tensor([1.0 if set(r[0].tolist()) == {0, 1} else 0.0 for r in rankings])
    assert 0 < rewards.sum() < len(rewards)
    before = _subset_prob(scores.detach()[0], {0, 1}, 2)
    loss, _ = reinforce_loss(scores, rankings, rewards, entropy_coef=0.0)
    loss.backward()
    with torch.no_grad():
        after = _subset_prob((scores - 0.5 * scores.grad)[0], {0, 1}, 2)
    assert after > before


# ----------------------------------------------------------------------------- features


def _hand_attention() -> torch.Tensor:
    """(1, 2, 2, 3): two heads, the last two queries of a 3-token causal prefill."""
    head0 = [[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]
    head1 = [[1.0, 0.0, 0.0], [0.6, 0.2, 0.2]]
    return torch.tensor([[head0, head1]])


def _entropy(row: list[float]) -> float:
    return -sum(p * math.log(p) for p in row if p > 0)


def test_features_equal_hand_computed_values():
    attn = _hand_attention()
    values = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]]]])  # (1, 1, 3, 2)
    n_vis = F.prefill_visibility(3, 2)
    assert n_vis.tolist() == [2, 2, 1]
    got = F.layer_features(attn, values, n_vis, torch.tensor([0.0, 0.5, 1.0]), groups=1)[0, 0]  # (3, 5)
    recv = [[0.35, 0.4, 0.5], [0.8, 0.1, 0.2]]  # per head: column sums / [2, 2, 1]
    alpha = [(a + b) / 2 for a, b in zip(*recv)]
    sigma = [((a - b) / 2) ** 2 for a, b in zip(*recv)]
    ent = [[_entropy(r) for r in head] for head in attn[0].tolist()]
    weighted = [
        [sum(attn[0, h, q, i].item() * ent[h][q] for q in range(2)) / attn[0, h, :, i].sum().item() for i in range(3)]
        for h in range(2)
    ]
    expected = torch.tensor(
        [
            [alpha[i], [5.0, 1.0, 1.0][i], sigma[i], (weighted[0][i] + weighted[1][i]) / 2, [0, 0.5, 1][i]]
            for i in range(3)
        ]
    )
    torch.testing.assert_close(got, expected)


def test_per_kv_head_features_split_the_heads():
    attn = _hand_attention()
    values = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]], [[0.0, 2.0], [2.0, 0.0], [0.0, 0.0]]]])
    got = F.layer_features(attn, values, F.prefill_visibility(3, 2), torch.linspace(0, 1, 3), groups=2)
    assert got.shape == (1, 2, 3, 5)
    torch.testing.assert_close(got[0, :, :, 0], torch.tensor([[0.35, 0.4, 0.5], [0.8, 0.1, 0.2]]))
    torch.testing.assert_close(got[0, :, :, 1], torch.tensor([[5.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    assert torch.all(got[..., 2] == 0)  # one query head per group: no spread


def test_global_features_average_the_layers():
    layers = [torch.full((1, 1, 4, 5), float(v)) for v in (1, 2, 6)]
    torch.testing.assert_close(F.global_features(layers), torch.full((1, 4, 5), 3.0))


# ----------------------------------------------------------------------------- policy


def test_policy_is_invariant_to_feature_scale():
    feats = torch.rand(2, 10, 5) + 0.1
    scaled = feats.clone()
    scaled[..., :2] *= 7.0  # alpha and value norm on another scale
    torch.testing.assert_close(standardise(feats), standardise(scaled))
    policy = _policy()
    torch.testing.assert_close(policy(feats), policy(scaled))


def test_keep_conversions():
    assert keep_count(512, 0.25) == 128 and keep_count(512, 64) == 64 and keep_count(10, 0.01) == 1
    assert compression_ratio(0.25) == 0.75
    with pytest.raises(ValueError, match="keep"):
        keep_count(10, 0.0)
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.8]])
    assert top_b(scores, 2).tolist() == [[1, 3]]


def test_policy_round_trips_through_safetensors(tmp_path):
    policy = _policy(per_head=False, window=7)
    policy.save(tmp_path / "p.safetensors")
    loaded = Policy.load(tmp_path / "p.safetensors")
    assert loaded.config == policy.config
    feats = torch.rand(1, 6, 5)
    torch.testing.assert_close(loaded(feats), policy(feats))
    with pytest.raises(ValueError, match="file missing"):
        Policy.load(tmp_path / "missing.safetensors")


# ----------------------------------------------------------------------------- press


PRESSES = {
    "DistillCache-per-head": lambda keep: DistillCachePress.keeping(_policy(True), keep),
    "DistillCache": lambda keep: DistillCachePress.keeping(_policy(False), keep),
    "snapkv": lambda keep: SnapKVPress(compression_ratio=compression_ratio(keep), window_size=4),
    "observed": lambda keep: ObservedAttentionPress(compression_ratio=compression_ratio(keep)),
    "knorm": lambda keep: KnormPress(compression_ratio=compression_ratio(keep)),
}


@pytest.mark.parametrize("keep", [0.5, 0.25])
@pytest.mark.parametrize("method", list(PRESSES))
def test_press_keeps_the_budget_and_removes_its_hooks(eager_tiny, method, keep):
    ids = _ids(24)
    with PRESSES[method](keep)(eager_tiny):
        pruned = hf.forward(eager_tiny, ids)
    assert hf.cache_len(pruned.cache) == [keep_count(24, keep)] * hf.n_layers(eager_tiny)
    assert hf.cache_len(hf.forward(eager_tiny, ids).cache) == [24] * hf.n_layers(eager_tiny)


def test_per_head_press_keeps_exactly_the_top_scores(eager_tiny):
    ids = _ids(24)
    press = DistillCachePress.keeping(_policy(True), 0.25)
    full = hf.forward(eager_tiny, ids, attentions=True)
    with press(eager_tiny):
        pruned = hf.forward(eager_tiny, ids)
    for layer, (keys, values, attn) in enumerate(zip(full.keys, full.values, full.attn)):
        scores = press.policy(F.prefill_layer_features(attn, values, 16, keys.shape[1]))
        idx = scores.topk(6, dim=-1).indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        torch.testing.assert_close(pruned.keys[layer], keys.gather(2, idx))


def test_global_press_keeps_one_top_set_for_all_layers(eager_tiny):
    ids = _ids(24)
    press = DistillCachePress.keeping(_policy(False), 0.25)
    full = hf.forward(eager_tiny, ids, attentions=True)
    glob = F.global_features([F.prefill_layer_features(a, v, 16, 1) for a, v in zip(full.attn, full.values)])
    idx = top_b(press.policy(glob), 6)  # (1, 6)
    with press(eager_tiny):
        pruned = hf.forward(eager_tiny, ids)
    for layer, keys in enumerate(full.keys):
        torch.testing.assert_close(pruned.keys[layer], keys[:, :, idx[0]])


def test_global_press_with_a_lazily_grown_cache(eager_tiny):
    """kvpress's pipeline prefills into DynamicCache(), whose layers appear one by one."""
    ids = _ids(24)
    cache = DynamicCache()
    with DistillCachePress.keeping(_policy(False), 0.25)(eager_tiny), torch.no_grad():
        hf.decoder(eager_tiny)(input_ids=ids, past_key_values=cache)
    assert hf.cache_len(cache) == [6] * hf.n_layers(eager_tiny)


def test_press_without_eager_attention_says_so():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="eager"), DistillCachePress.keeping(_policy(), 0.5)(model):
        hf.forward(model, _ids(12))


def test_observe_matches_the_press_scores(eager_tiny):
    ids = _ids(20)
    obs = observe(eager_tiny, ids, 16, {"stream": StreamingLLMPress(n_sink=2)}, (0.5,))
    assert obs.head_features.shape == (3, 1, 2, 20, 5) and obs.global_features.shape == (1, 20, 5)
    kept = [s.topk(10, dim=-1).indices for s in obs.scores[("stream", 0.5)]]
    cache = prune(eager_tiny, obs, kept)
    assert hf.cache_len(cache) == [10, 10, 10]
    positions = kept[0][0, 0].sort().values.tolist()
    assert positions == [0, 1] + list(range(12, 20))  # sinks + the most recent tokens


# ----------------------------------------------------------------------------- decode-time eviction


DECODE_SCORERS = {
    "distillcache": lambda: DistillCachePress(policy=_policy(True)),
    "knorm": KnormPress,
    "observed": ObservedAttentionPress,
}


@pytest.mark.parametrize("scorer", list(DECODE_SCORERS))
def test_decode_eviction_holds_the_budget_at_true_positions(eager_tiny, scorer):
    prompt, budget, steps = _ids(20), 8, 6
    lengths, caches = [], []
    evictor = DecodeEvictor(DECODE_SCORERS[scorer](), budget=budget, window=4)
    cache = hf.forward(eager_tiny, prompt[:, :-1]).cache
    with evictor(eager_tiny):
        out = hf.generate(
            eager_tiny,
            cache,
            prompt[:, -1:],
            19,
            steps,
            on_step=lambda c, s: (lengths.append(hf.cache_len(c)), caches.append(c)),
        )
    assert lengths == [[budget] * 3] * steps
    full = hf.forward(eager_tiny, torch.cat([prompt, torch.tensor([out[:-1]])], 1)).cache
    positions = evictor.states[0].positions  # (1, Hkv, budget)
    assert positions.max() <= 19 + steps - 1 and positions[0, 0].unique().numel() == budget
    full_keys = full.layers[0].keys.gather(2, positions.unsqueeze(-1).expand(-1, -1, -1, 8))
    torch.testing.assert_close(caches[-1].layers[0].keys, full_keys)  # layer-0 keys depend only on token and position


def test_decode_eviction_needs_a_positive_budget(eager_tiny):
    with pytest.raises(ValueError, match="at least 1"), DecodeEvictor(KnormPress(), budget=0)(eager_tiny):
        pass


# ----------------------------------------------------------------------------- trainer on a tiny model


def test_reinforce_step_on_a_tiny_model_gives_gradients(eager_tiny):
    ids = _ids(30)
    obs = observe(eager_tiny, ids[:, :24], 16)
    ref = hf.continue_logits(eager_tiny, hf.make_cache(eager_tiny, obs.keys, obs.values), ids[:, 24:], 24)[0]
    policy = _policy(True).train()
    cfg = TrainConfig(out="unused", samples=3)
    stats = reinforce_step(eager_tiny, policy, Sample(obs, ids[:, 24:], ref), 6, cfg, torch.Generator().manual_seed(0))
    stats["loss"].backward()
    assert stats["kl"] > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_cli_rejects_bad_input(capsys, tmp_path):
    from scdviz.__main__ import main

    assert main(["bench", "evict", "--modes", "sideways"]) == 2
    assert "invalid choice: 'sideways'" in capsys.readouterr().err
    assert main(["train-policy", "--out", str(tmp_path), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_decode_eviction_interval_bounds_the_cache(eager_tiny):
    prompt, lengths = _ids(20), []
    evictor = DecodeEvictor(KnormPress(), budget=8, interval=3)
    with evictor(eager_tiny):
        hf.generate(
            eager_tiny,
            hf.forward(eager_tiny, prompt[:, :-1]).cache,
            prompt[:, -1:],
            19,
            8,
            on_step=lambda c, s: lengths.append(hf.cache_len(c)[0]),
        )
    assert set(lengths) <= {8, 9, 10} and 10 in lengths and evictor.evictions > 0


def test_qa_item_quotes_the_context_and_answers_with_its_next_tokens():
    from scdviz import qa

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1000 + ord(c) for c in text]}

    context = list(range(300))
    for index in range(5):
        item = qa.make_item(Tok(), context, index, answer_len=3)
        cue = item.question[-qa.CUE :]
        p = cue[-1] + 1
        assert cue == context[p - qa.CUE : p] and item.answer == context[p : p + 3]
        assert 100 <= p < 200  # the middle third


def test_qa_answer_from_full_cache_of_a_repeating_model(tiny):
    """A cache that reproduces the model's own continuation answers its own question correctly."""
    from scdviz import qa
    from scdviz.models import hf

    ctx = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    question = [5, 6, 7]
    cache = hf.forward(tiny, ctx).cache
    seq = torch.cat([ctx, torch.tensor([question])], 1)  # greedy answer recomputed without any cache
    expected = []
    for _ in range(2):
        expected.append(int(tiny(seq).logits[0, -1].argmax()))
        seq = torch.cat([seq, torch.tensor([[expected[-1]]])], 1)
    got = qa.answer(tiny, cache, qa.QAItem(question=question, answer=expected), 40)
    assert got == {"answer": expected, "qa_correct": 1.0, "qa_f1": 1.0}
    wrong = qa.answer(tiny, cache, qa.QAItem(question=question, answer=[(expected[0] + 1) % 97, 96]), 40)
    assert wrong["qa_correct"] == 0.0


# ----------------------------------------------------------------------------- kvpress wrappers


def test_distillcache_presses_inside_kvpress_wrappers(eager_tiny, tmp_path):
    """As kvpress tests its own presses: through ComposedPress and KeyRerotationPress, from a saved file."""
    from kvpress import ComposedPress, KeyRerotationPress

    for per_head in (True, False):
        _policy(per_head).save(tmp_path / f"p{per_head}.safetensors")
    head = DistillCachePress.from_pretrained(tmp_path / "pTrue.safetensors", compression_ratio=0.5)
    glob = DistillCachePress.from_pretrained(tmp_path / "pFalse.safetensors", compression_ratio=0.5)
    assert head.policy.config.per_head and not glob.policy.config.per_head
    ids = _ids(40)
    with ComposedPress([head, KnormPress(compression_ratio=0.5)])(eager_tiny):
        assert hf.cache_len(hf.forward(eager_tiny, ids).cache) == [10] * 3  # 40 -> 20 -> 10
    with KeyRerotationPress(press=head)(eager_tiny):
        rerotated = hf.forward(eager_tiny, ids).cache
    assert hf.cache_len(rerotated) == [20] * 3
    for wrapper in (ComposedPress([glob, KnormPress(compression_ratio=0.5)]), KeyRerotationPress(press=glob)):
        with pytest.raises(ValueError, match="global DistillCache press"), wrapper(eager_tiny):
            hf.forward(eager_tiny, ids)
    with glob(eager_tiny):  # on its own it keeps one set for every layer
        assert hf.cache_len(hf.forward(eager_tiny, ids).cache) == [20] * 3


# ----------------------------------------------------------------------------- the lookahead feature


def test_lookahead_feature_is_the_attention_of_the_sampled_continuations(eager_tiny):
    ids, k = _ids(20), 3
    plain = observe(eager_tiny, ids, 16)
    obs = observe(eager_tiny, ids, 16, lookahead=(1, k), seed=5)
    assert obs.head_features.shape == (3, 1, 2, 20, 6) and obs.global_features.shape == (1, 20, 6)
    assert torch.equal(obs.head_features[..., :5], plain.head_features)  # the 5 features are untouched
    # by hand: K tokens drawn from the prefill's last logits with the same seeded generator, their attention rows
    trace = hf.forward(eager_tiny, ids)
    probs = torch.softmax(trace.logits[:, -1].float(), -1).expand(k, -1)
    tokens = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5))
    cache = hf.make_cache(eager_tiny, [x.expand(k, -1, -1, -1) for x in trace.keys],
                          [x.expand(k, -1, -1, -1) for x in trace.values])
    attn = hf.forward(eager_tiny, tokens, cache=cache, positions=torch.full((k, 1), 20), attentions=True).attn
    n_heads, n_kv, _ = hf.attn_heads(eager_tiny)
    want = torch.stack([a[:, :, 0, :20].reshape(k, n_kv, n_heads // n_kv, 20).sum(2).mean(0) for a in attn])
    torch.testing.assert_close(obs.head_features[:, 0, ..., 5], want)
    torch.testing.assert_close(obs.global_features[0, :, 5], want.mean((0, 1)))
    # each sampled row sums to 1 over context + itself: the context share is below the group size
    assert (want.sum(-1) <= n_heads // n_kv + 1e-5).all() and (want.sum(-1) > 0).all()
    again = observe(eager_tiny, ids, 16, lookahead=(1, k), seed=5)
    assert torch.equal(again.head_features, obs.head_features)  # seeded: one context, one feature


def test_a_lookahead_policy_refuses_features_without_it_and_others_ignore_it(eager_tiny):
    torch.manual_seed(0)
    look = Policy(PolicyConfig(hidden=8, window=16, lookahead=2)).eval()
    assert look.config.n_inputs == 6 and look.config.observation == (16, 2, 4)
    feats = observe(eager_tiny, _ids(20), 16, lookahead=(2, 2)).head_features
    assert look(feats).shape == (3, 1, 2, 20)
    with pytest.raises(ValueError, match="lookahead"):
        look(feats[..., :5])
    plain = _policy(True)
    assert torch.equal(plain(feats), plain(feats[..., :5]))  # a 5-feature policy reads the first five
    with (pytest.raises(ValueError, match="lookahead"),
          DistillCachePress(policy=look, compression_ratio=0.5)(eager_tiny)):
        hf.forward(eager_tiny, _ids(20))
    with (pytest.raises(ValueError, match="lookahead"),
          DecodeEvictor(DistillCachePress(policy=look), budget=8)(eager_tiny)):
        pass


def test_a_new_lookahead_policy_scores_as_its_prior_and_warm_starts_at_the_training_rate(eager_tiny):
    obs = observe(eager_tiny, _ids(20), 16, lookahead=(2, 2))
    look, alpha = obs.head_features[..., 5], obs.head_features[..., 0]
    prior = 0.75 * look / look.sum(-1, keepdim=True) + 0.25 * alpha / alpha.sum(-1, keepdim=True)
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(hidden=8, window=16, lookahead=2))
    with torch.no_grad():
        torch.testing.assert_close(policy(obs.head_features), prior.log())  # the correction starts at zero
        assert torch.equal(top_b(policy(obs.head_features), 5), top_b(prior, 5))
    no_prior = Policy(PolicyConfig(hidden=8, window=16, lookahead=2, lookahead_prior=0.0))
    assert not no_prior.has_prior and no_prior.mlp[-1].weight.abs().sum() > 0
    sample = Sample(obs, _ids(4), torch.zeros(4, 97))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-4)
    cfg = TrainConfig(out="unused", warm_steps=30, lr=1e-2, policy=policy.config)
    log = {"warm": []}
    warm_start(policy, [sample], cfg, opt, log)
    assert opt.param_groups[0]["lr"] == 1e-2 and log["warm"][-1] < log["warm"][0]  # imitated at REINFORCE's rate


def test_train_writes_no_file_and_hands_checkpoints_to_its_callback(tmp_path, monkeypatch):
    """fit(cfg, pair) -> artefact: train returns the policy chosen on validation with its log and writes
    nothing; every step and checkpoint goes to the callback, and checkpoints_to(folder) writes the run
    folder; a run resumed from that folder (load_checkpoint) goes on to the configured steps."""
    from scdviz.evict.train import Checkpoint, checkpoints_to, load_checkpoint, train

    class Words:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [sum(map(ord, w)) % 97 for w in text.split()]}

    monkeypatch.chdir(tmp_path)
    model = tiny_model("llama")
    cfg = TrainConfig(out=str(tmp_path / "never"), corpora=("austen",), contexts=2, context_len=40, cont_len=8, steps=4,
                      warm_steps=1, checkpoint_every=2, val_contexts=1, samples=2,
                      policy=PolicyConfig(hidden=4, per_head=True, window=8))
    events = []
    policy = train(cfg, (model, Words(), "tiny"), events.append, progress=False)
    assert list(tmp_path.iterdir()) == []  # no file, not even cfg.out
    assert [e.kind for e in events].count("step") == 4 and [e.step for e in events if e.kind == "step"] == [1, 2, 3, 4]
    checkpoints = [e for e in events if e.kind == "checkpoint"]
    assert ([e.step for e in checkpoints] == [0, 2, 4]
            and [e.val_kl for e in checkpoints] == [v["kl"] for v in policy.log["val"]])
    assert all(isinstance(e.checkpoint, Checkpoint) and e.checkpoint.optimizer["state"] is not None
               for e in checkpoints)
    low = min(v["kl"] for v in policy.log["val"])
    best = [v for v in policy.log["val"] if v["kl"] == low][-1]  # ties: the later checkpoint, as it always was
    assert policy.meta == {"steps": best["step"], "val_kl": best["kl"]} and not policy.training
    assert policy.identity["model_source"] == "tiny" and len(policy.log["steps"]) == 4

    folder = tmp_path / "run"
    first = train(TrainConfig(**{**cfg.__dict__, "steps": 2}), (model, Words(), "tiny"), checkpoints_to(folder),
                  progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["best.safetensors", "log.json", "optimizer.pt",
                                                       "policy.safetensors"]
    assert Policy.load(folder).log["val"] == first.log["val"]  # a folder reads as its best.safetensors + log
    resumed = train(cfg, (model, Words(), "tiny"), checkpoints_to(folder), state=load_checkpoint(folder),
                    progress=False)
    assert [s["kl"] for s in resumed.log["steps"]][:2] == [s["kl"] for s in first.log["steps"]]
    assert len(resumed.log["steps"]) == 4 and len(resumed.log["val"]) == 3
    last = Policy.load(folder / "policy.safetensors")
    assert last.meta == {"steps": 4} and json.loads((folder / "log.json").read_text())["val"] == resumed.log["val"]
    with pytest.raises(ValueError, match="not on 'other'"):
        train(cfg, (tiny_model("llama", seed=1), Words(), "other"), state=load_checkpoint(folder), progress=False)


def test_a_policy_saves_to_a_folder_and_loads_back_with_its_log(tmp_path):
    policy = _policy(True)
    policy.meta, policy.log = {"steps": 3, "val_kl": 0.5}, {"val": [{"step": 3, "kl": 0.5}]}
    assert policy.save(tmp_path / "mine") == tmp_path / "mine"
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["best.safetensors", "log.json"]
    back = Policy.load(tmp_path / "mine")
    assert back.meta == policy.meta and back.log == policy.log and back.config == policy.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), policy.state_dict().values()))
    assert Policy.load(tmp_path / "mine" / "best.safetensors").log == policy.log
    policy.save(tmp_path / "alone.safetensors")
    assert Policy.load(tmp_path / "alone.safetensors").log is None
