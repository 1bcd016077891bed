"""DistillCache tab: compress one context with every eviction method and compare.

Widgets and wiring only: the controls are built from ``EvictRequest``'s fields and reach
``run`` (from the webapp) as one ``EvictRequest``; it returns the retained-token views, texts,
table and figures.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from scdviz.app.requests import EvictRequest
from scdviz.app.ui import controls
from scdviz.app.ui.common import figure_downloads, guard, reporter
from scdviz.plots import FIGURE_LABELS, rounded, worded

FIGURES = ("kl_steps", "sweep", "heatmap", "features")


def build(run: Callable, examples: list[str], pair_state: gr.State, session: gr.State, export: Callable | None = None,
          request_type: type = EvictRequest) -> None:
    """Add the eviction tab's widgets (built from ``request_type``'s fields); ``run(pair_key, session, request)``
    checks the request and does the work (``progress``: a reporter, ``common.reporter``); ``export`` (see
    ``common.figure_downloads``) offers the figures as files."""
    gr.Markdown(
        "Prune the producer's cache of the context to a budget with the learned methods (the distilled scorer, "
        "DistillCache, the lookahead policy) and kvpress's baselines (one eager prefill serves all), then "
        "continue. KL is KL(full cache ‖ pruned) on the full cache's own greedy continuation. Same code as "
        "`python -m scdviz bench evict`."
    )
    widgets, run_button = controls.build_run(request_type, "context", examples,
                                             "Passages from the shipped evaluation text", "method",
                                             {"value": "Evict", "elem_id": "ev-run"})
    info = gr.Markdown(label="Summary", elem_id="ev-info")
    gr.Markdown("**Retained tokens** of the inspected method: darker = kept by more layers × KV heads.")
    kept = gr.HighlightedText(label="Retained tokens", combine_adjacent=False, show_legend=False, elem_id="ev-kept")
    gr.Markdown("**Difference from H2O** (ObservedAttention): positive = kept by the inspected method and dropped by "
                "H2O, negative = kept by H2O only (the difference in the share of layer × KV-head slots keeping the "
                "token; the largest darkest).")
    versus = gr.HighlightedText(label="Difference from H2O", combine_adjacent=False, show_legend=False,
                                elem_id="ev-versus")
    gr.Markdown("**At this budget**: the overlap and the share dropped compare the layer × KV-head slots each method "
                "keeps with H2O's.")
    table = gr.Dataframe(label="Methods at this budget", headers=["method"], interactive=False,
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

    def on_run(pair_key, session, progress=gr.Progress(), **values):  # noqa: B008 - gradio injects progress this way
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        out = run(pair_key, session, request_type(**values), progress=reporter(progress))
        return ([out["info"], out["kept"], out["versus"], rounded(worded(out["table"])), out["texts"],
                gr.update(choices=out["methods"], value=out.get("method"))]  # the method shown (another when
                + [out["figures"][n] for n in FIGURES] + [out["figures"]]       # the chosen one could not run)
                + [None] * len(downloads))  # a new run: the previous figure files go

    run_button.click(guard(on_run), [pair_state, session],
                        [info, kept, versus, table, texts, widgets["method"]] + [plots[n] for n in FIGURES] + [figs]
                        + downloads, inputs_kwargs=widgets, concurrency_limit=1, api_name="evict",
                     show_progress_on=[info])
