"""Results tab: open a benchmark file written by `python -m scdviz bench ... --out`, see it, export it.

Widgets and wiring only; ``load`` arrives from app.py.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from scdviz.ui.common import guard


def build(load: Callable, shipped: list[str], session: gr.State) -> None:
    """``load(path, session) -> (markdown, DataFrame, figure, csv_path)``; ``shipped``: names of bundled records."""
    gr.Markdown("Upload the JSON (or CSV) from `python -m scdviz bench scd|evict --out FILE`, or open one of the "
                "records shipped with the built-in pair.")
    with gr.Row():
        upload = gr.File(label="Benchmark JSON / CSV", file_types=[".json", ".csv"], elem_id="res-upload")
        bundled = gr.Dropdown(shipped, label="Shipped records", value=None, elem_id="res-shipped")
    info = gr.Markdown(elem_id="res-info")
    plot = gr.Plot(elem_id="res-plot")
    table = gr.Dataframe(interactive=False, elem_id="res-table")
    export = gr.File(label="Export as CSV", elem_id="res-export")

    def on_file(f, sess, request: gr.Request):
        if f is None:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return load(f if isinstance(f, str) else f.name, sess, request.session_hash if request else None)

    upload.change(guard(on_file), [upload, session], [info, table, plot, export], api_name="open_upload")
    bundled.change(guard(on_file), [bundled, session], [info, table, plot, export], api_name="open_shipped")
