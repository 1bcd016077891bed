"""Slow tier: the shipped DistillCache policies on the built-in producer (SmolLM2-135M)."""

from __future__ import annotations

import pytest
import torch

from scdviz.evict import bench
from scdviz.evict import features as F
from scdviz.evict.press import DistillCachePress
from scdviz.models import hf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def producer():
    from scdviz.models.pair import load_model

    model, tokenizer = load_model("builtin:smollm2-135m")
    hf.set_eager(model)
    return model, tokenizer


@pytest.fixture(scope="module")
def policies():
    missing = [p for p in bench.SHIPPED_POLICIES if not p.is_file()]
    assert not missing, f"shipped policies missing: {missing}"
    return bench.load_policies(())


@pytest.mark.parametrize("name", ["DistillCache-per-head", "DistillCache"])
def test_shipped_press_runs_in_the_kvpress_pipeline(producer, policies, name):
    from transformers import pipeline

    model, tokenizer = producer
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = "The lighthouse keeper of Ardmore was called Brennan. " * 12
    press = DistillCachePress.keeping(policies[name], 0.25)
    answer = pipe(context, question="Who kept the lighthouse?", press=press, max_new_tokens=4)["answer"]
    assert isinstance(answer, str) and answer.strip()


def test_learned_policy_beats_the_weak_baselines_on_held_out_text(producer, policies):
    model, tokenizer = producer
    cfg = bench.EvalConfig(
        limit=2, context_len=256, cont_len=16, keeps=(0.25,), token_budgets=()
    )
    windows = bench.contexts(cfg, tokenizer)
    per_ctx = [
        bench.score_context(model, torch.tensor([w.ids]), cfg.context_len, cfg, policies, bench.baselines())[
            "results"
        ]
        for w in windows
    ]
    records = bench.aggregate(
        per_ctx, model, "builtin", "agnostic", set(bench.baselines())
    )
    methods = [r for r in records if "kl" in r]
    kl = {r["method"]: r["kl"] for r in methods}
    assert kl["DistillCache-per-head"] < kl["Random"] and kl["DistillCache-per-head"] < kl["Knorm"]
    assert all(r["tokens_kept"] == 64 and r["n_contexts"] == 2 for r in methods)
    full = next(r for r in records if r["method"] == "full cache")  # the reference's own perplexity
    assert 1 < full["ppl"] < min(r["ppl"] for r in methods if r["method"] in ("Random", "Knorm"))


def test_the_shipped_choices_follow_their_logs():
    """The headline is the shipped artefact whose log validated as the benchmark scores (its tail, spread windows)
    with the lowest KL over its own H2O line; it is cheap (no lookahead), so it is also the cheap choice; the
    expensive reference the app shows beside it is a lookahead policy; without the headline's file the choice
    falls to another shipped artefact. The focus set starts with the two."""
    loaded = bench.load_all(())
    chosen = bench.chosen_on_validation((), question_len=16)
    assert loaded[chosen].validated_like_the_bench(16) and not bench.expensive(loaded[chosen])
    assert bench.cheap_on_validation((), question_len=16) == chosen
    reference = bench.expensive_on_validation((), question_len=16)
    assert bench.expensive(loaded[reference]) and reference != chosen
    assert bench.focus_methods()[:2] == [chosen, reference]
    path = next(p for p in bench.SHIPPED_POLICIES if bench.load_all((str(p),)).keys() == {chosen})
    without = tuple(str(p) for p in bench.SHIPPED_POLICIES if p != path)
    assert bench.chosen_on_validation(without, question_len=16) not in (None, chosen)


def test_the_lookahead_forecasts_what_the_real_continuation_reads(producer):
    """On held-out text, the tokens the sampled continuations attend to most overlap the tokens the real
    continuation attends to most (its future attention) more than the tokens attention history ranks first."""
    from scdviz import data
    from scdviz.evict.context import observe

    model, tokenizer = producer
    n_kv, overlap = hf.attn_heads(model)[1], {"alpha": [], "lookahead": []}
    for corpus in ("austen", "manpages"):
        ids = torch.tensor([data.token_windows(tokenizer, data.load_split(corpus, "eval"), 280, 1)[0]])
        obs = observe(model, ids[:, :256], 64, lookahead=(16, 4))
        trace = hf.forward(model, ids[:, 256:], cache=hf.make_cache(model, obs.keys, obs.values),
                           positions=torch.arange(256, 280).unsqueeze(0), attentions=True)
        future = F.future_attention(trace.attn, 256, n_kv)[0][:, 0]  # (L, Hkv, T)
        want = future.topk(32, -1).indices
        for name, col in (("alpha", 0), ("lookahead", 5)):
            got = obs.head_features[:, 0, ..., col].topk(32, -1).indices
            overlap[name].append(float((got.unsqueeze(-1) == want.unsqueeze(-2)).any(-1).float().mean()))
    print("top-32 overlap with the real continuation's future attention:", overlap)  # the policy README quotes it
    assert all(la > al + 0.1 for la, al in zip(overlap["lookahead"], overlap["alpha"], strict=True)), overlap


def test_the_eviction_view_runs_the_chosen_methods_and_a_subset_changes_no_number(producer):
    """The app's focused set: only the chosen methods (and H2O, every method's comparison) run; a native
    press has its row, text and one sweep point but no token view; a method scores the same whichever
    others run beside it."""
    from scdviz import data
    from scdviz.evict.view import H2O, eviction_view

    model, tok = producer
    context = tok.decode(data.eval_windows(tok, "bible", "dev", 140, 1)[0].ids)
    few = eviction_view(model, tok, context, methods=["SnapKV"])
    more = eviction_view(model, tok, context, methods=["SnapKV", "StreamingLLM", "KVzip"])
    assert {r["method"] for r in few.rows} == {"SnapKV", H2O} == set(few.kept_fraction)
    assert {r["method"] for r in more.rows} == {"SnapKV", H2O, "StreamingLLM", "KVzip"}
    assert "KVzip" not in more.kept_fraction and len(more.sweep["KVzip"]) == 1 and more.generations["KVzip"]
    kl_few, kl_more = ({r["method"]: r["kl"] for r in v.rows} for v in (few, more))
    assert kl_few["SnapKV"] == kl_more["SnapKV"] and kl_few[H2O] == kl_more[H2O]
    assert few.kept_fraction["SnapKV"] == more.kept_fraction["SnapKV"]
