"""SCD tab: one prompt through every transfer method, plan controls, text, table and plots.

Widgets and wiring only; ``run`` arrives from app.py and returns (table rows, headers,
texts per method, figures, info markdown).
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from scdviz.app.ui.common import diff_tokens, figure_downloads, guard, redraw_on_select
from scdviz.plots import rounded

FIGURES = ("drift_k", "drift_v", "accumulation", "amplification", "placement", "spectra_k", "spectra_v", "pareto",
           "ttft", "plan")
# the plots' sub-tabs (every figure in one), so the text, table and controls stay in view
GROUPS = {"Quality": ("pareto",), "Drift and error": ("drift_k", "drift_v", "accumulation", "amplification"),
          "Compression": ("plan", "placement", "spectra_k", "spectra_v"), "Timing": ("ttft",)}


def build(run: Callable, examples: list[str], pair_state: gr.State, session: gr.State, max_chars: int = 16384,
          max_rank: int = 192, export: Callable | None = None) -> None:
    """Add the SCD tab's widgets; ``run(pair_key, session, text, controls...)`` checks the controls and does the work;
    ``export`` (see ``common.figure_downloads``) offers the figures as files."""
    gr.Markdown(
        "The producer prefills the text; each method moves its cache to the consumer, which scores the last "
        "*continuation* tokens teacher-forced and generates greedily. KL is KL(oracle ‖ method) per token; "
        "the oracle is the consumer's own prefill. Same code as `python -m scdviz bench scd`."
    )
    text = gr.Textbox(label="Text (prompt + continuation)", lines=5, value=examples[0] if examples else "",
                      elem_id="scd-text", max_length=max_chars)
    if examples:
        gr.Examples([[e] for e in examples], inputs=[text], label="Windows from the shipped evaluation text")
    with gr.Row():
        cont = gr.Slider(8, 64, value=32, step=8, label="Continuation tokens scored")
        gen = gr.Slider(4, 48, value=24, step=4, label="Tokens generated per method")
        bits = gr.Radio([4, 8, 16], value=4, label="Code precision (bits)")
    with gr.Row():
        rank_k = gr.Slider(0, max_rank, value=0, step=8, label="r_K (0 = operating point)")
        rank_v = gr.Slider(0, max_rank, value=0, step=8, label="r_V (0 = operating point)")
        patch_k = gr.Slider(0, 8, value=2, step=1, label="Patch layers k")
        placement = gr.Radio(["selected", "drift", "manual"], value="selected", label="Placement")
        layers = gr.Textbox(label="Manual patch layers (e.g. 14, 18)", value="")
        budget = gr.Number(value=0, minimum=0, maximum=100_000, label="Byte budget, B/token (0 = the controls; "
                           "else the budget coder decides)", elem_id="scd-budget")
        coder = gr.Radio([("transform coding: one step per section, entropy coded", "transform"),
                          ("rate-distortion plan: ranks, bits and patches", "rd")], value="transform",
                         label="Budget coder", elem_id="scd-coder")
    with gr.Row():
        gbps = gr.Slider(0.5, 100, value=10, label="Link bandwidth (Gbit/s)")
        latency = gr.Slider(0.0, 20.0, value=0.5, step=0.5, label="Link latency (ms)")
        fan_out = gr.Checkbox(value=False, label="All built-in specialists (one table)")
        go_btn = gr.Button("Transfer", variant="primary", elem_id="scd-run")
    info = gr.Markdown(elem_id="scd-info")
    table = gr.Dataframe(label="Results (one prompt)", interactive=False, elem_id="scd-table")
    texts = gr.HighlightedText(label="Generated text per method (tokens that differ from the oracle's are marked)",
                               combine_adjacent=False, show_inline_category=False, show_legend=True,
                               color_map={"differs": "orange"}, elem_id="scd-texts")
    figs = gr.State({})
    plots = {}
    with gr.Tabs(elem_id="scd-plot-tabs"):
        for title, names in GROUPS.items():
            with gr.Tab(title, elem_id=f"scd-tab-{title.split()[0].lower()}") as tab:
                redraw_on_select(tab)
                for i in range(0, len(names), 2):
                    with gr.Row():
                        for name in names[i : i + 2]:
                            plots[name] = gr.Plot(elem_id=f"scd-{name}", label=name)
    assert set(plots) == set(FIGURES)
    downloads = [figure_downloads("scd", figs, session, export)] if export is not None else []

    def on_run(key, sess, txt, c, g, b, rk, rv, k, place, lay, bw, lat, fan, bud, cod, progress=gr.Progress()):  # noqa: B008
        if not key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        progress(0.1, desc="transferring with every method")
        out = run(key, sess, txt, c, g, b, rk, rv, k, place, lay, bw, lat, fan, bud, cod)
        segments = []
        oracle = out["texts"][0][1]
        for method, tokens in out["texts"]:
            segments.append((f"\n{method}: ", None))
            segments += diff_tokens(tokens, oracle)
        return ([out["info"], rounded(out["table"]), segments] + [out["figures"][n] for n in FIGURES]
                + [out["figures"]] + [None] * len(downloads))  # a new run: the previous figure files go

    go_btn.click(guard(on_run), [pair_state, session, text, cont, gen, bits, rank_k, rank_v, patch_k, placement, layers,
                                 gbps, latency, fan_out, budget, coder],
                 [info, table, texts] + [plots[n] for n in FIGURES] + [figs] + downloads,
                 concurrency_limit=1, api_name="scd")
