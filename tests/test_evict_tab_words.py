"""The eviction tab says what it shows: which method is the headline and which the expensive reference, one name
per method everywhere on the page, and, when one context disagrees with the benchmark, what the benchmark says
over its many contexts (read from the shipped record, never written here)."""

from __future__ import annotations

import re
from pathlib import Path

import gradio as gr
import pytest

from scdviz import metrics, plots, records
from scdviz.app import evict
from scdviz.app.requests import HEADLINE_SCORER, EvictRequest

ROOT = Path(__file__).resolve().parents[1]
# H2O is named only to say what ObservedAttention is, in parentheses right after that name
H2O_GLOSS = re.compile(r"ObservedAttention`?\s*\([^()]*\)")


def _tab_words() -> list[str]:
    """Every text, label, help line and table header of the eviction tab as built for the page."""
    from scdviz.app.ui import evict_tab

    with gr.Blocks() as demo:
        state = gr.State("")
        evict_tab.build(lambda *a, **k: None, ["an example context"], state, state)
    words = []
    for block in demo.blocks.values():
        if isinstance(block, gr.Markdown):
            words.append(block.value or "")
        elif isinstance(block, gr.components.Component):
            words += [str(block.label or ""), str(getattr(block, "info", None) or "")]
            if isinstance(block, gr.Dropdown):
                words += [str(c[0]) for c in block.choices]
    return words + [plots.HEADERS[c] for c in ("method", "kl", "top1", "tokens_kept", "jaccard_vs_h2o",
                                               "kept_not_by_h2o", "role")]


def _slug(heading: str) -> str:
    """A markdown heading's anchor, as GitHub and the Hub make it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_tab_names_the_headline_and_the_expensive_reference():
    from scdviz.evict import bench

    words = "\n".join(_tab_words())
    assert f"**`{HEADLINE_SCORER}` is the headline**" in words  # the intro
    assert "**`lookahead-policy` is an expensive reference**" in words and "samples" in words
    info = dict(EvictRequest.controls()["methods"].props)["info"]  # the methods control's help line
    assert info.startswith(f"{HEADLINE_SCORER} is the headline")
    assert "lookahead-policy is an expensive reference" in info
    assert "continuations" in info and "baselines" in info
    assert HEADLINE_SCORER == bench.SCORER and bench.LOOKAHEAD == "lookahead-policy"  # the names the texts use
    assert bench.focus_methods()[:2] == [HEADLINE_SCORER, bench.LOOKAHEAD]  # the default set: both, then baselines


def test_each_method_has_one_name_on_the_page():
    """kvpress's ObservedAttention is ObservedAttention in the methods list, the table's headers and every text;
    H2O appears only to say what it is. The methods list offers every method by the name the API accepts."""
    from scdviz.evict import bench
    from scdviz.evict.view import H2O

    assert evict.H2O == H2O == "ObservedAttention"  # the tab's name is the view's, the table's and the API's
    words = _tab_words()
    text = "\n".join(words)
    assert "Difference from ObservedAttention" in text and "overlap with ObservedAttention's kept slots" in text
    assert "H2O" not in H2O_GLOSS.sub("ObservedAttention", text), [w for w in words if "H2O" in w]
    assert "ObservedAttention" in bench.method_names() and "H2O" not in bench.method_names()
    offered = EvictRequest.controls()["methods"].options()
    assert offered == bench.method_names()  # the values the API accepts, unchanged
    assert EvictRequest(context="x", methods=["ObservedAttention", HEADLINE_SCORER]).checked().methods == [
        "ObservedAttention", HEADLINE_SCORER]


def test_every_method_has_a_role():
    from scdviz.evict import bench

    assert evict.role(HEADLINE_SCORER) == "headline"
    assert evict.role(bench.LOOKAHEAD) == evict.role(bench.LOOKAHEAD + "-w64") == "reference (expensive)"
    for name in [*bench.baselines(), *bench.native_baselines()]:
        assert evict.role(name) == "baseline", name
    for name in (bench.DISTILLCACHE, bench.DISTILLCACHE_PER_HEAD, HEADLINE_SCORER + "-closed-form", "lodo-austen"):
        assert evict.role(name) == "learned (not the headline)", name
    assert evict.role("yours:mine") == "yours"


def _expected(keep: str) -> dict:
    """The headline against ObservedAttention at ``keep`` in the record the README cites for the headline,
    computed here from the record's rows."""
    readme = (ROOT / "README.md").read_text()
    rel = "assets/policy/bench/student_window_test.json"
    assert f"`{rel}`" in readme  # the record the README's headline rows are written from
    rows = {r["method"]: r for r in records.read(ROOT / rel).rows if r.get("keep") == keep
            and r.get("mode") == "agnostic" and "kl_per_context" in r}
    ours, theirs = rows[HEADLINE_SCORER], rows["ObservedAttention"]
    boot = metrics.paired_bootstrap(theirs["kl_per_context"], ours["kl_per_context"], clusters=ours["passages"])
    wins = sum(a < b for a, b in zip(ours["kl_per_context"], theirs["kl_per_context"], strict=True))
    return {"ratio": f"{boot['ratio']:.2f}×", "ci": f"[95% CI {boot['ratio_ci'][0]:.2f}, {boot['ratio_ci'][1]:.2f}]",
            "wins": f"{wins / len(ours['kl_per_context']):.0%}", "n": f"over {len(ours['kl_per_context'])} contexts",
            "rel": rel}


def test_a_context_where_the_headline_loses_to_observedattention_gets_the_benchmarks_word():
    worse = evict.benchmark_note({HEADLINE_SCORER: 0.2267, "ObservedAttention": 0.159, "KVzip": 0.0954}, 0.25)
    want = _expected("0.25")
    assert worse.startswith(f" On this one context {HEADLINE_SCORER} (the headline) scores worse than "
                            "ObservedAttention (KL 0.2267 vs 0.159), but one context is noisy:")
    for part in want.values():
        assert part in worse, (part, worse)
    assert "at 25 % kept (" in worse and "nearest" not in worse
    docs = (ROOT / "docs" / "results.md").read_text()
    section = evict.BENCH_DOCS.split("#")[1]
    assert evict.BENCH_DOCS.startswith("docs/results.md#") and evict.BENCH_DOCS in worse
    assert section in {_slug(h) for h in re.findall(r"^#+ (.+)$", docs, re.M)}  # the link names a real section
    # the budget the benchmark holds nearest the visitor's: 12.5 % for 10 % kept, said so
    near = evict.benchmark_note({HEADLINE_SCORER: 0.3, "ObservedAttention": 0.2}, 0.10)
    for part in _expected("0.125").values():
        assert part in near, (part, near)
    assert "at 12.5 % kept (its budget nearest this one)" in near
    # no note where the headline does as well or better, or where either did not run
    for kls in ({HEADLINE_SCORER: 0.1, "ObservedAttention": 0.2}, {HEADLINE_SCORER: 0.2, "ObservedAttention": 0.2},
                {HEADLINE_SCORER: 0.3, "SnapKV": 0.2}, {"ObservedAttention": 0.2, "SnapKV": 0.3},
                {HEADLINE_SCORER: float("nan"), "ObservedAttention": 0.2}):
        assert evict.benchmark_note(kls, 0.25) == "", kls


def _first_example() -> str:
    """The page's first example context (``webapp._examples(3, 2000)``: the first corpus's second passage)."""
    from scdviz import data

    return data.load_split(data.corpora()[0], "eval")[1][:2000].rsplit(" ", 1)[0]


@pytest.mark.slow
def test_the_run_on_the_pages_first_example_says_what_each_method_is(builtin_pair):
    """The page's defaults on its first example: the table's second column gives each method's role, the summary
    speaks of the benchmark exactly when the headline scores worse than ObservedAttention, and the plots' legends
    use the table's names, every trace visible."""
    from scdviz.app.ui.evict_tab import FIGURES
    from scdviz.evict import bench

    out = evict.evict_run(builtin_pair, EvictRequest(_first_example()))
    table = out["table"]
    assert list(table.columns[:2]) == ["method", "role"]
    roles = dict(zip(table["method"], table["role"], strict=True))
    assert set(roles) == set(bench.focus_methods())
    assert roles[HEADLINE_SCORER] == "headline" and roles["lookahead-policy"] == "reference (expensive)"
    assert {roles[m] for m in bench.FOCUS_BASELINES} == {"baseline"}
    shown = plots.rounded(plots.worded(table))  # what the page and the API show
    assert list(shown.columns[:2]) == ["method", "role"]
    assert "overlap with ObservedAttention's kept slots (Jaccard)" in shown
    kls = dict(zip(table["method"], table["kl"], strict=True))
    assert out["info"].startswith(f"{HEADLINE_SCORER}: keeps ")
    worse = kls[HEADLINE_SCORER] > kls["ObservedAttention"]
    assert ("one context is noisy" in out["info"]) == worse, (kls, out["info"])
    if worse:
        for part in _expected("0.25").values():
            assert part in out["info"], (part, out["info"])
        assert evict.BENCH_DOCS in out["info"]
    figures = evict.evict_figures(out["figures"])
    for name in ("kl_steps", "sweep"):
        legend = {t.name for t in figures[name].data}
        assert legend == set(table["method"]), (name, legend)  # one name per method: the table's
        assert all(t.opacity >= 0.55 for t in figures[name].data)
    assert set(FIGURES) == set(figures)
