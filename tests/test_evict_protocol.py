"""Fast tier: the eviction benchmark's protocol (bootstrap comparisons, wins, domains, choice on
validation) and kvpress's own presses run through ``hf.press_prefill`` on tiny models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from scdviz import data, metrics
from scdviz.evict import bench
from scdviz.evict.policy import Policy, PolicyConfig
from scdviz.models import hf


def _ctx(kls: dict[str, float]) -> dict:
    return {(m, "0.25"): {"kl": v, "top1": 0.5, "nll": [1.0], "tokens_kept": 8} for m, v in kls.items()}


def test_aggregate_compares_every_method_to_the_best_and_to_each_contexts_best():
    model = tiny_model("llama")
    per_ctx = [_ctx({"learned": 0.10, "A": 0.20, "B": 0.05}),
               _ctx({"learned": 0.10, "A": 0.12, "B": 0.30}),
               _ctx({"learned": 0.30, "A": 0.10, "B": 0.11})]
    rows = bench.aggregate(per_ctx, model, "tiny", "agnostic", {"A", "B"},
                             windows=[data.Window([], d, p) for d, p in (("x", 0), ("x", 1), ("y", 0))],
                             chosen="learned", failed={"C": "no gates"})
    by = {r["method"]: r for r in rows}
    assert by["A"]["best_baseline"] == "A" and by["A"]["kl_minus_best"] is None  # A: mean .14 < B: .153
    boot = metrics.paired_bootstrap([0.20, 0.12, 0.10], [0.10, 0.10, 0.30])
    assert by["learned"]["kl_minus_best"] == pytest.approx(boot["diff"], abs=1e-5)
    assert by["learned"]["kl_minus_best_ci95"] == pytest.approx(boot["diff_ci"], abs=1e-5)
    assert by["learned"]["wins_vs_best_baseline"] == pytest.approx(2 / 3)
    assert by["learned"]["wins_vs_context_best"] == pytest.approx(1 / 3)  # only context 2 (0.10 < 0.12)
    assert by["learned"]["chosen_on_validation"] and not by["B"]["chosen_on_validation"]
    assert by["C"]["cannot_run"] == "no gates" and by["learned"]["domains"] == ["x", "x", "y"]
    per_domain = {r["domain"]: r for r in bench.domain_table(rows).to_dict("records")}
    assert per_domain["x"]["best_baseline"] == "A" and per_domain["y"]["best_baseline"] == "A"
    assert per_domain["x"]["kl"] == pytest.approx(0.10) and per_domain["x"]["wins"] == 1.0
    assert per_domain["y"]["n"] == 1 and per_domain["y"]["ci95"] is None


def test_aggregate_drops_a_method_missing_on_some_context():
    model = tiny_model("llama")
    per_ctx = [_ctx({"A": 0.2, "late": 0.1}), _ctx({"A": 0.2})]
    rows = bench.aggregate(per_ctx, model, "tiny", "agnostic", {"A", "late"})
    assert [r["method"] for r in rows] == ["A"]


def test_contexts_spread_evenly_over_the_domains():
    class Words:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [hash(w) % 97 for w in text.split()]}

    cfg = bench.EvalConfig(corpora=("austen", "bible", "jargon"), limit=7, context_len=40, question_len=4, cont_len=4)
    domains = [w.domain for w in bench.contexts(cfg, Words())]
    assert len(domains) == 7 and domains[:3] == ["austen", "bible", "jargon"]
    assert max(domains.count(d) for d in set(domains)) - min(domains.count(d) for d in set(domains)) <= 1
    Words.bos_token_id = 96
    plain = bench.contexts(cfg, Words())
    with_bos = bench.contexts(dataclasses.replace(cfg, bos=True), Words())
    assert all(w.ids[0] == 96 and len(w.ids) == 48 == len(p.ids) for w, p in zip(with_bos, plain, strict=True))
    assert [w.domain for w in bench.contexts(dataclasses.replace(cfg, slice="test"), Words())] == domains


def test_the_policy_with_the_lowest_validation_kl_is_chosen(tmp_path):
    paths = []
    for name, window, vals in (("a", 16, [0.3, 0.2]), ("b", 8, [0.25, 0.15, 0.4])):
        folder = tmp_path / name
        folder.mkdir()
        torch.manual_seed(0)
        Policy(PolicyConfig(hidden=4, per_head=True, window=window)).save(folder / "best.safetensors")
        (folder / "log.json").write_text(json.dumps({"val": [{"step": i, "kl": v} for i, v in enumerate(vals)]}))
        paths.append(str(folder / "best.safetensors"))
    assert bench.validation_kl(paths[1]) == 0.15
    assert bench.chosen_on_validation(tuple(paths)) == "DistillCache-per-head-w8"
    assert set(bench.load_policies(tuple(paths))) == {"DistillCache-per-head", "DistillCache-per-head-w8"}
    # a log validated as the benchmark scores (its tail after 16 unscored tokens, windows spread through the
    # split) competes only with logs like it: a KL on another tail or on first windows is not comparable
    folder = tmp_path / "c"
    folder.mkdir()
    Policy(PolicyConfig(hidden=4, per_head=True, window=32)).save(folder / "best.safetensors")
    like = {"question_len": 16, "spread": True}
    (folder / "log.json").write_text(json.dumps({"config": like, "val": [{"step": 0, "kl": 0.5}]}))
    paths.append(str(folder / "best.safetensors"))
    assert bench.chosen_on_validation(tuple(paths), question_len=16) == "DistillCache-per-head-w32"
    assert bench.chosen_on_validation(tuple(paths), question_len=4) == "DistillCache-per-head-w8"  # none alike: all
    first = tmp_path / "first"  # the bench's tail, but first windows: not alike
    first.mkdir()
    Policy(PolicyConfig(hidden=4, per_head=True, window=24)).save(first / "best.safetensors")
    (first / "log.json").write_text(json.dumps({"config": {"question_len": 16, "spread": False},
                                                "val": [{"step": 0, "kl": 0.001}]}))
    assert bench.chosen_on_validation((*paths, str(first / "best.safetensors")), 16) == "DistillCache-per-head-w32"
    # a lookahead policy (several prefills per context, prefill only) can be the headline; the cheap choice
    # (what the app shows beside it) leaves it out, and has none when nothing cheap has a log
    folder = tmp_path / "look"
    folder.mkdir()
    Policy(PolicyConfig(hidden=4, per_head=True, window=32, lookahead=4)).save(folder / "best.safetensors")
    (folder / "log.json").write_text(json.dumps({"config": like, "val": [{"step": 0, "kl": 0.01}]}))
    both = (*paths, str(folder / "best.safetensors"))
    assert bench.chosen_on_validation(both, question_len=16) == "lookahead-policy"
    assert bench.cheap_on_validation(both, question_len=16) == "DistillCache-per-head-w32"
    assert bench.cheap_on_validation((str(folder / "best.safetensors"),), question_len=16) is None
    # logs that each hold their heuristic's KL on their own contexts compete by the ratio to it: a higher KL
    # on harder contexts can be the better policy
    for name, kl, line in (("c", 0.5, 0.6), ("look", 0.3, 0.2)):
        log = json.loads((tmp_path / name / "log.json").read_text()) | {"val_heuristic": line}
        (tmp_path / name / "log.json").write_text(json.dumps(log | {"val": [{"step": 0, "kl": kl}]}))
    assert bench.chosen_on_validation(both, question_len=16) == "DistillCache-per-head-w32"  # 0.83x its line vs 1.5x
    assert bench.expensive_on_validation(both, question_len=16) == "lookahead-policy"
    # once the cheap log is not alike (first windows), the alike one wins however the other did
    log = json.loads((tmp_path / "c" / "log.json").read_text())
    log["config"]["spread"] = False
    (tmp_path / "c" / "log.json").write_text(json.dumps(log))
    assert bench.chosen_on_validation(both, question_len=16) == "lookahead-policy"  # 1.5x its line
    assert bench.cheap_on_validation(both, question_len=16) == "DistillCache-per-head-w8"  # none alike: the lowest KL


def test_continue_logits_of_a_ragged_cache_equals_one_token_at_a_time():
    model = tiny_model("llama")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    full = hf.forward(model, ids[:, :32]).cache
    keys, values = hf.cache_kv(full)
    keep = [torch.arange(0, 32, 1 + i) for i in range(len(keys))]  # 32, 16, 11 tokens per layer
    cache = hf.make_cache(model, [k[:, :, i] for k, i in zip(keys, keep, strict=True)],
                          [v[:, :, i] for v, i in zip(values, keep, strict=True)])
    assert len(set(hf.cache_len(cache))) == 3
    got = hf.continue_logits(model, cache, ids[:, 32:], 32)
    step = hf.clone_cache(model, cache)
    want = torch.cat([hf.forward(model, ids[:, j:j + 1], cache=step, positions=torch.tensor([[j]])).logits
                      for j in range(32, 40)], dim=1)
    torch.testing.assert_close(got, want)
    assert hf.cache_len(cache) == [32, 16, 11]  # the caller's cache is untouched


@pytest.mark.parametrize("name", ["AdaKV-SnapKV", "CriticalAdaKV-SnapKV", "PyramidKV", "CriticalKV-SnapKV"])
def test_native_presses_keep_the_budget_and_leave_nothing_on_the_model(name):
    model = tiny_model("llama")
    hf.set_eager(model)  # the benchmark's setting: press_prefill switches to sdpa and back
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(5))
    make = bench.native_baselines()[name]
    with hf.press_prefill(model, make(0.75), ids[:, :96]) as cache:
        assert hf.kept_per_head(model, cache) == pytest.approx(24)
        pruned = hf.continue_logits(model, cache, ids[:, 96:], 96)
    assert model.config._attn_implementation == "eager"
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in hf.layers(model))
    full = hf.continue_logits(model, hf.forward(model, ids[:, :96]).cache, ids[:, 96:], 96)
    assert not torch.allclose(pruned, full)  # the budget acts on the continuation


def test_score_context_reports_a_native_press_that_cannot_run():
    model = tiny_model("llama")
    hf.set_eager(model)
    torch.manual_seed(0)
    policies = {"DistillCache-per-head": Policy(PolicyConfig(hidden=4, per_head=True, window=8)).eval()}
    cfg = bench.EvalConfig(keeps=(0.25,), token_budgets=(), cont_len=4, question_len=0)
    natives = {k: v for k, v in bench.native_baselines().items() if k in ("KVzip", "AdaKV-SnapKV")}
    failed = {}
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(2))
    out = bench.score_context(model, ids, 96, cfg, policies, bench.baselines(), natives=natives, failed=failed)
    assert "KVzip" in failed and failed["KVzip"]  # no tokenizer for a random model: said, not raised
    assert out["results"][("AdaKV-SnapKV", "0.25")]["tokens_kept"] == pytest.approx(24)
    assert ("KVzip", "0.25") not in out["results"]
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in hf.layers(model))


class _Words:
    """A fake tokenizer: one id per word (hash mod the tiny vocabulary)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [sum(map(ord, w)) % 97 for w in text.split()]}


def test_future_attention_sums_each_group_and_averages_the_rows():
    from scdviz.evict import features as F

    gen = torch.Generator().manual_seed(0)
    attn = [torch.softmax(torch.randn(1, 4, 3, 10, generator=gen), -1) for _ in range(2)]  # 4 heads, 2 KV heads
    head, glob = F.future_attention(attn, 7, 2)
    assert head.shape == (2, 1, 2, 7) and glob.shape == (1, 7)
    for layer in range(2):
        for kv in range(2):
            want = sum(attn[layer][0, h, :, :7].mean(0) for h in (2 * kv, 2 * kv + 1))
            torch.testing.assert_close(head[layer, 0, kv], want)
    torch.testing.assert_close(glob[0], head[:, 0].mean((0, 1)))


def test_training_samples_score_the_tail_after_the_question_as_the_benchmark_does():
    """With question_len q the sample teacher-forces q + n tokens after the context and scores the
    last n: its reference is the full cache's logits there, and a rollout's KL is measured on them."""
    from scdviz.evict import train
    from scdviz.evict.context import prune

    model = tiny_model("llama")
    cfg = train.TrainConfig(out="unused", corpora=("austen",), context_len=40, question_len=6, cont_len=8,
                              policy=PolicyConfig(hidden=4, per_head=True, window=8))
    sample = train.prepare(model, _Words(), cfg, "calib", 1, progress=False)[0]
    assert sample.cont.shape == (1, 14) and sample.ref.shape[0] == 8
    full = hf.continue_logits(model, hf.make_cache(model, sample.obs.keys, sample.obs.values), sample.cont, 40)[0]
    assert torch.allclose(sample.ref, full[-8:], atol=1e-5)
    everything = [torch.arange(40).view(1, 1, 40).expand(1, 2, 40)] * 3
    assert train.rollout_kl(model, sample, everything) < 1e-6  # nothing pruned: the reference itself
    idx = [torch.arange(20, 40).view(1, 1, 20).expand(1, 2, 20)] * 3
    pruned = hf.continue_logits(model, prune(model, sample.obs, idx), sample.cont, 40)[0]
    expect = float(metrics.kl_per_token(full[-8:], pruned[-8:]).mean())
    assert abs(train.rollout_kl(model, sample, idx) - expect) < 1e-6
    assert abs(expect - float(metrics.kl_per_token(full, pruned).mean())) > 1e-6  # the question's steps differ


def test_agreement_with_h2o_is_exact_on_known_masks():
    from scdviz.evict.view import agreement, slot_masks

    head = [torch.tensor([[[0, 1], [2, 3]]]), torch.tensor([[[0, 2], [1, 3]]])]  # 2 layers, 2 KV heads, keep 2 of 4
    glob = torch.tensor([[0, 1]])  # one set for every layer and head
    a, b = slot_masks(head, 4, 2, 2), slot_masks(glob, 4, 2, 2)
    assert a.shape == (2, 2, 4) and a.sum() == 8 and b[:, :, :2].all() and not b[:, :, 2:].any()
    assert agreement(a, a) == {"jaccard_vs_h2o": 1.0, "kept_not_by_h2o": 0.0}
    both = 2 + 1 + 1  # layer 0 head 0 shares {0, 1}; layer 1 head 0 shares {0}, head 1 shares {1}
    assert agreement(a, b) == {"jaccard_vs_h2o": round(both / (16 - both), 3),
                               "kept_not_by_h2o": round(1 - both / 8, 3)}


def test_decode_quality_holds_every_cache_at_the_budget_and_matches_the_full_cache_when_nothing_is_cut():
    model = tiny_model("llama")
    hf.set_eager(model)
    torch.manual_seed(0)
    policies = {"DistillCache-per-head": Policy(PolicyConfig(hidden=4, per_head=True, window=8)).eval(),
                "DistillCache": Policy(PolicyConfig(hidden=4, per_head=False, window=8)).eval()}
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(4))
    presses = {k: v for k, v in bench.baselines().items() if k in ("ObservedAttention", "Knorm", "TOVA")}
    for keep, n_keep in ((0.25, 24), (1.0, 96)):
        cfg = bench.EvalConfig(keeps=(keep,), token_budgets=(), cont_len=4, question_len=0, decode_tokens=12,
                                 decode_interval=4)
        out = bench.score_context(model, ids, 96, cfg, policies, presses)
        failed = {}
        res = bench.decode_context(model, ids, 96, cfg, out, policies, presses, failed)
        # ObservedAttention continues as H2O: its prefill, then every decode row accumulated (scdviz.evict.h2o)
        assert {m for m, _ in res} == {"DistillCache-per-head", bench.H2O, "Knorm", "TOVA"}
        assert not failed
        for r in res.values():
            assert len(r["kl_steps"]) == 12 and r["tokens_kept"] == n_keep
            if keep == 1.0:  # budget = the whole context: decode-time eviction still cuts the generated tokens
                assert r["kl_steps"][0] == pytest.approx(0.0, abs=1e-5)  # the first step sees the full cache
            else:
                assert r["kl"] > 0


def test_a_scorer_that_raises_on_the_model_is_reported_and_left_out():
    from dataclasses import dataclass

    from kvpress import KnormPress, ScorerPress

    @dataclass
    class Broken(ScorerPress):
        def score(self, *args, **kwargs):
            raise AttributeError("no rotary embedding for this layer type")

    model = tiny_model("llama")
    hf.set_eager(model)
    torch.manual_seed(0)
    policies = {"DistillCache-per-head": Policy(PolicyConfig(hidden=4, per_head=True, window=8)).eval()}
    cfg = bench.EvalConfig(keeps=(0.25,), token_budgets=(), cont_len=4, question_len=0)
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(2))
    failed = {}
    out = bench.score_context(model, ids, 96, cfg, policies, {"Broken": Broken(), "Knorm": KnormPress()},
                                failed=failed)
    assert failed == {"Broken": "AttributeError: no rotary embedding for this layer type"}
    assert {m for m, _ in out["results"]} == {"DistillCache-per-head", "Knorm", "full cache"}


def test_lodo_retrains_the_chosen_recipe_without_each_training_domain(tmp_path, monkeypatch):
    """--lodo: the chosen policy's recipe (its log's settings) is trained again once per training
    domain without it, saved in the runs folder, and scored on that domain alone, beside the
    shipped policy and the baselines; the per-domain table says the domain was held out of it."""
    from scdviz.evict import train

    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    model = tiny_model("llama")
    recipe = train.TrainConfig(out=str(tmp_path / "recipe"), corpora=("austen", "gcide"), contexts=2, context_len=40,
                                 cont_len=6, steps=2, warm_steps=2, checkpoint_every=1, val_contexts=2, samples=2,
                                 policy=PolicyConfig(hidden=4, per_head=True, window=8))
    train.train(recipe, (model, _Words(), "tiny"), train.checkpoints_to(recipe.out), progress=False)
    written = tmp_path / "recipe" / "log.json"  # the recipe as its log says it ran: first windows
    old = json.loads(written.read_text())
    old["config"]["spread"] = False
    written.write_text(json.dumps(old))
    cfg = bench.EvalConfig(policies=(str(tmp_path / "recipe" / "best.safetensors"),), corpora=("austen", "gcide",
                             "jargon"), limit=6, context_len=40, cont_len=6, question_len=0, keeps=(0.25,),
                             token_budgets=(), natives=False, lodo=True, lodo_steps=1)
    record = bench.run(cfg, (model, _Words(), "tiny"))
    assert record.kind == "evict" and record.settings["eval"]["lodo"]
    rows = record.rows
    for domain, other in (("austen", "gcide"), ("gcide", "austen")):
        mine = [r for r in rows if r["mode"] == f"agnostic lodo-{domain}" and r.get("method") == f"lodo-{domain}"]
        assert len(mine) == 1 and mine[0]["trained_on"] == [other] and mine[0]["chosen_on_validation"]
        assert set(mine[0]["domains"]) == {domain} and mine[0]["n_contexts"] == 2
        log = json.loads((Path(mine[0]["policy_folder"]) / "log.json").read_text())
        assert log["config"]["corpora"] == [other] and len(log["steps"]) == 1
        assert log["config"]["question_len"] == recipe.question_len == 16  # the recipe's validation tail, kept
        assert log["config"]["spread"] is False  # the recipe's, from its log
        assert Path(mine[0]["policy_folder"]).is_relative_to(tmp_path / "work" / "runs" / "policies")
    table = bench.domain_table(rows).to_dict("records")
    lodo_rows = [r for r in table if "lodo" in r["mode"]]
    assert {(r["domain"], r["held_out"]) for r in lodo_rows} == {("austen", True), ("gcide", True)}
    main = {r["domain"]: r["held_out"] for r in table if r["mode"] == "agnostic"}
    assert main == {"austen": False, "gcide": False, "jargon": True}  # the recipe's own policy trained on two


def test_scorer_names_run_only_those_presses_at_prefill_and_while_decoding(tmp_path):
    """--scorer-names: a long decode run on many contexts scores the named kvpress scorers alone (the best
    baseline is then the best of them); an unknown scorer or native press is refused by name before any work."""
    from scdviz.evict import train

    model = tiny_model("llama")
    recipe = train.TrainConfig(out=str(tmp_path / "recipe"), corpora=("austen",), contexts=2, context_len=40,
                               cont_len=6, steps=1, warm_steps=1, checkpoint_every=1, val_contexts=2, samples=2,
                               policy=PolicyConfig(hidden=4, per_head=True, window=8))
    train.train(recipe, (model, _Words(), "tiny"), train.checkpoints_to(recipe.out), progress=False)
    policy = str(tmp_path / "recipe" / "best.safetensors")
    cfg = bench.EvalConfig(policies=(policy,), corpora=("austen", "gcide"), limit=2, context_len=40, cont_len=4,
                           question_len=0, keeps=(0.25,), token_budgets=(), natives=False, decode_tokens=8,
                           scorer_names=("ObservedAttention", "TOVA"))
    rows = bench.run(cfg, (model, _Words(), "tiny")).rows
    by_mode = {}
    for r in rows:
        by_mode.setdefault(r["mode"], set()).add(r["method"])
    learned = {r["method"] for r in rows if r["method"].startswith(bench.LEARNED)}
    assert len(learned) == 1
    assert by_mode["agnostic"] == {"ObservedAttention", "TOVA", "full cache"} | learned
    assert by_mode["agnostic decode8"] == {bench.H2O, "TOVA"} | learned
    assert {r["best_baseline"] for r in rows if r["method"] in learned} <= {"ObservedAttention", bench.H2O, "TOVA"}
    for bad, word in ((dict(scorer_names=("H2O",)), "scorer"), (dict(natives=True, native_names=("KVZip",)),
                                                                 "native")):
        with pytest.raises(ValueError, match=f"unknown {word} press.*{bad.get('scorer_names', ('KVZip',))[0]}"):
            bench.measure(dataclasses.replace(cfg, **bad), {})
