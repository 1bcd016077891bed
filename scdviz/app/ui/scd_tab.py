"""SCD tab: one prompt through every transfer method, plan controls, text, table and plots.

Widgets and wiring only: the controls are built from ``ScdRequest``'s fields and reach ``run``
(from the webapp) as one ``ScdRequest``, built by field name; ``run`` returns a dict (info,
table, texts per method, each method's answer to the consumer's question, figures).
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from scdviz.app.requests import ScdRequest
from scdviz.app.ui import controls
from scdviz.app.ui.common import diff_tokens, figure_downloads, guard, redraw_on_select, reporter, show_on_open
from scdviz.plots import FIGURE_LABELS, rounded, worded

FIGURES = ("drift_k", "drift_v", "accumulation", "amplification", "placement", "spectra_k", "spectra_v", "pareto",
           "compute", "ttft", "plan")
# the plots' sub-tabs (every figure in one), so the text, table and controls stay in view
GROUPS = {"Quality": ("pareto", "compute"), "Drift and error": ("drift_k", "drift_v", "accumulation", "amplification"),
          "Compression": ("plan", "placement", "spectra_k", "spectra_v"), "Timing": ("ttft",)}


def answered(answers: dict | None) -> list[tuple[str, str | None]]:
    """The question's segments for gr.HighlightedText: the question, the reference answer, then each method's
    answer with its token-F1, its tokens marked where they differ from the reference's (None: not asked)."""
    if not answers:
        return [("Not asked (tick \"Ask its question\").", None)]
    what = {"before": "the words before a quote, nearest first", "quote": "the words that continue a quote"}
    segments = [(f"Asked ({what.get(answers['kind'], answers['kind'])}):{answers['question']}", None),
                ("\nreference: ", None)] + [(t, None) for t in answers["reference"]]
    for method, tokens, f1 in answers["methods"]:
        segments.append((f"\n{method} (F1 {f1:.2f}): ", None))
        segments += diff_tokens(tokens, answers["reference"])
    return segments


def build(run: Callable, examples: list[str], pair_state: gr.State, session: gr.State, export: Callable | None = None,
          request_type: type = ScdRequest, first: Callable | None = None, demo: gr.Blocks | None = None) -> None:
    """Add the SCD tab's widgets; ``run(pair_key, session, request)`` checks the request and does the work;
    ``export`` (see ``common.figure_downloads``) offers the figures as files. ``request_type``: the
    dataclass whose fields are the controls (``ScdRequest``, or a subclass with more). ``first()``: the result
    (as ``run``'s) the page shows when it opens, before any run (``demo``: the Blocks whose load shows it)."""
    gr.Markdown(
        "The producer prefills the text; each method moves its cache to the consumer, which scores the last "
        "*continuation* tokens teacher-forced and generates greedily. KL is KL(oracle ‖ method) per token; "
        "the oracle is the consumer's own prefill. Same code as `python -m scdviz bench scd`."
    )
    widgets, run_button = controls.build_run(request_type, "text", examples, "Windows from the shipped evaluation text",
                                             "fan_out", {"value": "Transfer", "elem_id": "scd-run"})
    info = gr.Markdown(label="Summary", elem_id="scd-info")
    table = gr.Dataframe(label="Results (one prompt)", headers=["method"], interactive=False, elem_id="scd-table")
    texts = gr.HighlightedText(label="Generated text per method (marked: differs from the oracle)",
                               combine_adjacent=False, show_inline_category=False, show_legend=True,
                               color_map={"differs": "orange"}, elem_id="scd-texts")
    answers = gr.HighlightedText(label="The consumer's question about the text: each method's answer (marked: differs "
                                 "from the reference)", combine_adjacent=False, show_inline_category=False,
                                 show_legend=True, color_map={"differs": "orange"}, elem_id="scd-answers")
    figs = gr.State({})
    plots = {}
    with gr.Tabs(elem_id="scd-plot-tabs"):
        for title, names in GROUPS.items():
            with gr.Tab(title, elem_id=f"scd-tab-{title.split()[0].lower()}") as tab:
                redraw_on_select(tab)
                for i in range(0, len(names), 2):
                    with gr.Row():
                        for name in names[i : i + 2]:
                            plots[name] = gr.Plot(elem_id=f"scd-{name}", label=FIGURE_LABELS[name])
    assert set(plots) == set(FIGURES)
    downloads = [figure_downloads("scd", figs, session, export)] if export is not None else []

    def shown(out: dict) -> list:
        """The tab's outputs for one run's result (``run``'s dict)."""
        segments = []
        oracle = out["texts"][0][1]
        for method, tokens in out["texts"]:
            segments.append((f"\n{method}: ", None))
            segments += diff_tokens(tokens, oracle)
        return ([out["info"], rounded(worded(out["table"])), segments, answered(out.get("answers"))]
                + [out["figures"][n] for n in FIGURES] + [out["figures"]]
                + [None] * len(downloads))  # a new run: the previous figure files go

    def on_run(pair_key, session, progress=gr.Progress(), **values):  # noqa: B008 - gradio injects progress this way
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        return shown(run(pair_key, session, request_type(**values), progress=reporter(progress)))

    outputs = [info, table, texts, answers] + [plots[n] for n in FIGURES] + [figs] + downloads
    run_button.click(guard(on_run), [pair_state, session], outputs, inputs_kwargs=widgets, concurrency_limit=1,
                     api_name="scd_transfer", show_progress_on=[info])
    if first is not None:  # opening the page shows a finished analysis of the first example (computed once)
        show_on_open(demo, first, shown, outputs, info)
