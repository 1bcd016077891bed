"""Slow tier: the eval slices with the built-in pair's tokenizer: what was read before the protocol is
in dev, and the test slice is big enough for every headline (>= 64 items)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from scdviz import data

pytestmark = pytest.mark.slow

# The largest windows any record or script read before the slices existed, all from the opening of each
# eval split: the eviction protocol's 11 contexts of 512 + 16 + 32 tokens per corpus (the most), the SCD
# benches' 16 prompts of 256 + 32, the TTFT bench's 3 prompts of 1024 + 1 (jargon).
READ_BEFORE = ((560, 11), (288, 16), (1025, 3))


@pytest.mark.parametrize("corpus", sorted(data.corpora()))
def test_every_window_read_before_the_protocol_lies_in_dev(builtin_pair, corpus):
    tok = builtin_pair.tokenizer
    passages = data.load_split(corpus, "eval")
    dev = len(data.slice_passages(passages, "dev"))
    lengths = [len(tok(p + "\n\n", add_special_tokens=False)["input_ids"]) for p in passages]
    ends = list(itertools.accumulate(lengths))
    for length, count in READ_BEFORE:
        read = length * count  # tokens read from the start of the split
        last = next(i for i, end in enumerate(ends) if end >= read)  # the passage holding the last token read
        assert last < dev, f"{corpus}: {count} windows of {length} reach passage {last}, dev ends at {dev}"


@pytest.mark.parametrize(("corpus", "length", "n"), [("austen", 288, 64), ("jargon", 288, 64)]
                         + [(c, 560, 11) for c in ("austen", "bible", "gcide", "handbook", "jargon", "manpages")])
def test_the_test_slice_holds_every_headline(builtin_pair, corpus, length, n):
    """The SCD headlines: 64 prompts of 256 + 32 tokens on each specialist's own domain; the eviction
    headline: 66 contexts, 11 per corpus. Windows are distinct and come from many passages."""
    windows = data.eval_windows(builtin_pair.tokenizer, corpus, "test", length, n)
    assert len(windows) == n and len({tuple(w.ids) for w in windows}) == n
    dev_end = len(data.slice_passages(data.load_split(corpus, "eval"), "dev"))
    assert min(w.passage for w in windows) >= dev_end
    assert len({w.cluster for w in windows}) >= min(n, 20)


# ----------------------------------------------------------------------------- the shipped headlines reproduce


@pytest.mark.parametrize("specialist", ["jargon", "austen-before"])
def test_the_scd_test_record_reproduces_on_its_first_prompts(specialist):
    """Rerun the first 2 prompts of the SCD headline record (test slice) from its own settings: raw KV and SCD
    give the recorded per-prompt KL (float tolerance: another machine's BLAS)."""
    from scdviz import config, records, settings
    from scdviz.commands import BenchScd
    from scdviz.models.pair import load_pair
    from scdviz.scd import bench, calibration

    rec = records.read(settings.ASSETS_DIR / "scd" / specialist / "test.json")
    cmd, _ = config.from_dict(BenchScd, rec.settings)
    assert cmd.bench.slice == "test" and not rec.versions["git_commit"].endswith("+dirty")
    pair = load_pair(cmd.producer, f"builtin:{specialist}")
    calib = calibration.Calibration.load(calibration.shipped_folder(pair.consumer_source), pair)
    domain = rec.rows[0]["domain"]
    windows = bench.eval_windows(None, cmd.bench, pair, domain)[:2]
    by = {r["method"]: r for r in rec.rows if r.get("row") == "measured" and r["group"] == "method"}
    assert by["raw KV"]["passages"][:2] == [w.cluster for w in windows]
    quick = dataclasses.replace(cmd.bench, gen_tokens=0, sent_rows=False, budgets=(), qa_answer_len=0)
    import torch

    torch.manual_seed(quick.seed)
    report = bench.bench(pair, calib, [w.ids for w in windows], quick, specialist, progress=False)
    got = {r.method: r.kl_per_prompt for r in report.methods}
    for method in ("raw KV", "4-bit KV", "SCD full"):
        assert got[method] == pytest.approx(by[method]["kl_per_prompt"][:2], rel=2e-3, abs=2e-5), method


@pytest.fixture(scope="module")
def producer():
    from scdviz.models import hf
    from scdviz.models.pair import load_model

    model, tokenizer = load_model("builtin:smollm2-135m")
    hf.set_eager(model)
    return model, tokenizer


def _scored(producer, cfg, windows, names):
    """bench.score_context on ``windows`` for the shipped policies and students ``names`` and H2O: KL per (method,
    keep)."""
    from scdviz.evict import bench
    from scdviz.models import hf

    model, _ = producer
    policies = {n: p for n, p in bench.load_policies(()).items() if n in names}
    presses = {"ObservedAttention": bench.baselines(cfg.seed)["ObservedAttention"]}
    presses |= bench.student_presses({n: s for n, s in bench.load_students(()).items() if n in names})
    out: dict[tuple[str, str], list[float]] = {}
    for w in windows:
        res = bench.score_context(model, hf.ids_tensor(w.ids), cfg.context_len, cfg, policies, presses)["results"]
        for key, value in res.items():
            if "kl" in value:
                out.setdefault(key, []).append(value["kl"])
    return out


def test_the_eviction_test_record_reproduces_on_its_first_contexts(producer):
    """The headline eviction record (test slice): its first 2 contexts rescored give the recorded KL of the chosen
    policy and of H2O at both budgets."""
    from scdviz import config, records, settings
    from scdviz.commands import BenchEvict
    from scdviz.evict import bench

    rec = records.read(settings.ASSETS_DIR / "policy" / "bench" / "test.json")
    cmd, _ = config.from_dict(BenchEvict, rec.settings)
    assert cmd.eval.slice == "test" and not rec.versions["git_commit"].endswith("+dirty")
    windows = bench.contexts(cmd.eval, producer[1])[:2]
    chosen = next(r["method"] for r in rec.rows if r.get("chosen_on_validation"))
    got = _scored(producer, cmd.eval, windows, {chosen})
    for r in rec.rows:
        if r.get("mode") == "agnostic" and r.get("method") in (chosen, "ObservedAttention") and "kl_per_context" in r:
            assert r["passages"][:2] == [w.cluster for w in windows]
            assert got[(r["method"], r["keep"])] == pytest.approx(r["kl_per_context"][:2], rel=2e-3, abs=2e-5)


def test_the_headline_policy_beats_h2o_on_dev_contexts(producer):
    """The claim, not "beats Random": on 6 dev contexts (one per domain, spread through the slice), the policy
    chosen on validation has a lower mean KL than H2O (ObservedAttention) over both headline budgets."""
    from scdviz.evict import bench

    cfg = bench.EvalConfig(limit=6, keeps=(0.25, 0.125), token_budgets=(), natives=False)
    chosen = bench.chosen_on_validation((), cfg.question_len)
    got = _scored(producer, cfg, bench.contexts(cfg, producer[1]), {chosen})
    mine = sum(sum(got[(chosen, k)]) for k in ("0.25", "0.125"))
    h2o = sum(sum(got[("ObservedAttention", k)]) for k in ("0.25", "0.125"))
    assert mine < h2o, f"{chosen}: {mine / 12:.4f} vs H2O {h2o / 12:.4f} mean KL"
