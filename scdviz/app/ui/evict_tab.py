"""DistillCache tab: compress one context with every eviction method and compare.

Widgets and wiring only: the controls are built from ``EvictRequest``'s fields and reach
``run`` (from the webapp) as one ``EvictRequest``; it returns the retained-token views, texts,
table and figures.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from scdviz.app.evict import BASELINE, BENCH_DOCS, H2O, HEADLINE, LEARNED_OTHER, REFERENCE
from scdviz.app.requests import HEADLINE_SCORER, EvictRequest
from scdviz.app.ui import controls
from scdviz.app.ui.common import figure_downloads, guard, reporter, show_on_open
from scdviz.plots import FIGURE_LABELS, rounded, worded

FIGURES = ("kl_steps", "sweep", "heatmap", "features")

# The tab's words. Each method has one name everywhere on the page (the methods list, the table, the plots'
# legends and these texts): kvpress's ObservedAttention is called that throughout, H2O named once as what it is.
INTRO = (
    "Prune the producer's cache of the context to a budget with every method ticked, then continue. "
    f"**`{HEADLINE_SCORER}` is the headline**: the shipped distilled scorer, a linear score per token, layer and KV "
    "head fitted to the attention that the text after a context pays, cheap at a prefill and while decoding. "
    "**`lookahead-policy` is an expensive reference**, not a rival: DistillCache's MLP with one more feature, the "
    "attention each token receives from continuations sampled from the context, so every prefill first generates "
    "several continuations (compute no other method spends), and it cannot run while decoding. `DistillCache` and "
    "`DistillCache-per-head` are the learned method as designed. The rest are **baselines**, kvpress's presses (one "
    f"eager prefill serves its scorers): `{H2O}` (kvpress's press for H2O's score, the attention each token has "
    "received), SnapKV, KVzip, StreamingLLM and more. The table's *role* column says which is which "
    f"({HEADLINE}, {REFERENCE}, {LEARNED_OTHER}, {BASELINE}, yours). "
    "KL is KL(full cache ‖ pruned) on the full cache's own greedy continuation. One context is noisy: the benchmark's "
    f"numbers over many contexts are in `{BENCH_DOCS}`. Same code as `python -m scdviz bench evict`."
)
VERSUS = (f"**Difference from {H2O}**: positive = kept by the inspected method and dropped by {H2O}, negative = kept "
          f"by {H2O} only (the difference in the share of layer × KV-head slots keeping the token; the largest "
          "darkest).")
AT_BUDGET = (f"**At this budget**: each method's role; the overlap and the share dropped compare the layer × KV-head "
             f"slots each method keeps with {H2O}'s.")


def build(run: Callable, examples: list[str], pair_state: gr.State, session: gr.State, export: Callable | None = None,
          request_type: type = EvictRequest, first: Callable | None = None, demo: gr.Blocks | None = None) -> None:
    """Add the eviction tab's widgets (built from ``request_type``'s fields); ``run(pair_key, session, request)``
    checks the request and does the work (``progress``: a reporter, ``common.reporter``); ``export`` (see
    ``common.figure_downloads``) offers the figures as files. ``first()``: the result (as ``run``'s) the page shows
    when it opens, before any run (``demo``: the Blocks whose load shows it)."""
    gr.Markdown(INTRO)
    widgets, run_button = controls.build_run(request_type, "context", examples,
                                             "Passages from the shipped evaluation text", "method",
                                             {"value": "Evict", "elem_id": "ev-run"})
    info = gr.Markdown(label="Summary", elem_id="ev-info")
    gr.Markdown("**Retained tokens** of the inspected method: darker = kept by more layers × KV heads.")
    kept = gr.HighlightedText(label="Retained tokens", combine_adjacent=False, show_legend=False, elem_id="ev-kept")
    gr.Markdown(VERSUS)
    versus = gr.HighlightedText(label=f"Difference from {H2O}", combine_adjacent=False, show_legend=False,
                                elem_id="ev-versus")
    gr.Markdown(AT_BUDGET)
    table = gr.Dataframe(label="Methods at this budget", headers=["method", "role"], interactive=False,
                         elem_id="ev-table")  # filled by a run
    texts = gr.Dataframe(headers=["method", "generated from the pruned cache"], label="Generated text",
                         interactive=False, wrap=True, elem_id="ev-texts")
    figs = gr.State({})
    plots = {}
    for row in (FIGURES[:2], FIGURES[2:]):
        with gr.Row():
            for name in row:
                plots[name] = gr.Plot(elem_id=f"ev-{name}", label=FIGURE_LABELS[name])
    downloads = [figure_downloads("ev", figs, session, export, name="evict")] if export is not None else []

    def shown(out: dict) -> list:
        """The tab's outputs for one run's result (``run``'s dict)."""
        return ([out["info"], out["kept"], out["versus"], rounded(worded(out["table"])), out["texts"],
                gr.update(choices=out["methods"], value=out.get("method"))]  # the method shown (another when
                + [out["figures"][n] for n in FIGURES] + [out["figures"]]       # the chosen one could not run)
                + [None] * len(downloads))  # a new run: the previous figure files go

    def on_run(pair_key, session, progress=gr.Progress(), **values):  # noqa: B008 - gradio injects progress this way
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        return shown(run(pair_key, session, request_type(**values), progress=reporter(progress)))

    outputs = [info, kept, versus, table, texts, widgets["method"]] + [plots[n] for n in FIGURES] + [figs] + downloads
    run_button.click(guard(on_run), [pair_state, session], outputs, inputs_kwargs=widgets, concurrency_limit=1,
                     api_name="evict", show_progress_on=[info])
    if first is not None:  # opening the page shows a finished analysis of the first example (computed once)
        show_on_open(demo, first, shown, outputs, info)
