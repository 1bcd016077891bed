"""Pair tab: choose a producer and consumer, load them with progress, see facts and the
compatibility verdict, and generate from both side by side.

Widgets and wiring only; the processing functions arrive in ``PairTabFns``; the generation
controls are built from ``GenerateRequest``'s fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from scdviz.app.requests import GenerateRequest
from scdviz.app.ui import controls
from scdviz.app.ui.common import diff_tokens, guard, reporter


@dataclass
class PairTabFns:
    """What the tab calls (supplied by app.py)."""

    producer_choices: list[str]  # built-in producer sources offered in the dropdown
    consumer_choices: list[str]  # built-in consumer sources offered in the dropdown
    default_producer: str  # preselected producer
    default_consumer: str  # preselected consumer
    load: Callable  # (producer, consumer, progress) -> (summary_md, facts_rows, pair_key)
    generate: Callable  # (pair_key, GenerateRequest, progress=reporter) -> (prod_tokens, cons_tokens, info_md)
    examples: list[str]  # example prompts


def build(fns: PairTabFns, pair_state: gr.State, demo: gr.Blocks) -> None:
    """Add the Pair tab's widgets to the current Blocks and wire them; the default pair
    loads when the page opens."""
    gr.Markdown(
        "Pick a **producer** (runs the prefill) and a **consumer** (fine-tuned, same architecture). "
        "Built-in sources need no download; you may also type a local model folder, a LoRA adapter "
        "folder (applied to the producer) or a hub id."
    )
    with gr.Row():
        producer = gr.Dropdown(fns.producer_choices, value=fns.default_producer, label="Producer",
                               allow_custom_value=True, elem_id="producer")
        consumer = gr.Dropdown(fns.consumer_choices, value=fns.default_consumer, label="Consumer",
                               allow_custom_value=True, elem_id="consumer")
        load_btn = gr.Button("Load pair", variant="primary", elem_id="load-pair")
    summary = gr.Markdown(label="Pair summary", elem_id="pair-summary")
    facts = gr.Dataframe(headers=["fact", "producer", "consumer"], label="Model facts", interactive=False,
                         wrap=True, column_widths=["16%", "42%", "42%"],  # a long fact (Gemma-3's RoPE per
                         elem_id="pair-facts")  # layer type) wraps in its column: producer and consumer stay in view

    gr.Markdown("### Generate from both (each from its own prefill)")
    buttons = {}

    def add_button(_):
        buttons["generate"] = gr.Button("Generate", elem_id="pair-generate")

    widgets = controls.build(GenerateRequest, {"prompt": fns.examples[0] if fns.examples else ""},
                             after={"chat": add_button})
    if fns.examples:
        gr.Examples([[e] for e in fns.examples], inputs=[widgets["prompt"]],
                    label="Examples from the shipped evaluation text")
    info = gr.Markdown(label="Summary", elem_id="pair-gen-info")
    with gr.Row():
        prod_out = gr.HighlightedText(label="Producer", elem_id="producer-text", combine_adjacent=False)
        cons_out = gr.HighlightedText(label="Consumer (tokens that differ from the producer's are marked)",
                                      elem_id="consumer-text", combine_adjacent=False,
                                      color_map={"differs": "orange"}, show_inline_category=False,
                                      show_legend=True)

    def on_load(producer, consumer, progress=gr.Progress()):  # noqa: B008 - gradio injects progress this way
        def report(frac, msg):
            progress(frac, desc=msg)

        md, rows, key = fns.load(producer, consumer, report)
        return md, rows, key

    def on_generate(pair_key, progress=gr.Progress(), **values):  # noqa: B008 - gradio injects progress this way
        if not pair_key:
            raise gr.Error("load a pair first", print_exception=False)
        prod_tokens, cons_tokens, md = fns.generate(pair_key, GenerateRequest(**values), progress=reporter(progress))
        return md, [(t, None) for t in prod_tokens], diff_tokens(cons_tokens, prod_tokens)

    # a refused pair's message (an unsupported family lists the supported ones) stays until it is closed, and the
    # progress (and the failure's badge) shows on the summary alone: the facts of the pair still loaded stay readable
    load_btn.click(guard(on_load, duration=None), [producer, consumer], [summary, facts, pair_state],
                   concurrency_limit=1, api_name="load_pair", show_progress_on=[summary])
    demo.load(guard(on_load, duration=None), [producer, consumer], [summary, facts, pair_state], concurrency_limit=1,
              api_name=False, show_progress_on=[summary])
    buttons["generate"].click(guard(on_generate), [pair_state], [info, prod_out, cons_out], inputs_kwargs=widgets,
                              concurrency_limit=1, api_name="generate", show_progress_on=[info])
