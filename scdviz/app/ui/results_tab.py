"""Results tab: open several benchmark records (`python -m scdviz bench ... --out`) at once and compare
them: one plot per kind with every record overlaid, the settings that differ, every row, exports.

Widgets and wiring only; ``load`` and ``export`` arrive from app.py.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from scdviz.app.ui.common import figure_downloads, guard

FIGURES = ("payload_vs_kl", "kl_vs_budget", "ttft")  # scdviz.plots.record_figures' names, one per kind
TITLES = {"payload_vs_kl": "SCD: payload vs KL", "kl_vs_budget": "Eviction: KL vs budget", "ttft": "TTFT"}


def build(load: Callable, shipped: list[str], session: gr.State, export: Callable | None = None,
          local_runs: Callable[[], list[str]] | None = None, runs_folder: str = "") -> None:
    """``load(shipped_names, uploaded_paths, run_names, session, http) -> dict`` (``http``: the gr.Request;
    the dict holds info, figures, settings, table, csv); ``shipped``: names of bundled records;
    ``local_runs()``: names of the bench runs in the local runs folder (None: not offered, as in hosted mode)."""
    gr.Markdown("Open one or several records (JSON or CSV from `python -m scdviz bench scd|evict|ttft`) to "
                "compare them: each kind gets one plot with every record overlaid (a marker and legend group per "
                "record; hover a point for its method and values), then the settings that differ and every row.")
    with gr.Row():
        bundled = gr.Dropdown(shipped, label="Shipped records", value=[], multiselect=True, elem_id="res-shipped",
                              scale=2)
        if local_runs is not None:
            with gr.Column(scale=2):
                local = gr.Dropdown(local_runs(), label=f"Your bench runs ({runs_folder})", value=[],
                                    multiselect=True, elem_id="res-runs")
                refresh = gr.Button("↻ list the runs again", size="sm", elem_id="res-runs-refresh")
        else:
            local = gr.Dropdown([], value=[], multiselect=True, visible=False, elem_id="res-runs")
            refresh = None
        upload = gr.File(label="Upload records (JSON / CSV, several at once)", file_types=[".json", ".csv"],
                         file_count="multiple", elem_id="res-upload", scale=2, height=140)
    info = gr.Markdown(label="Summary", elem_id="res-info")
    figs = gr.State({})
    plots = {name: gr.Plot(elem_id=f"res-{name}", label=TITLES[name], visible=False) for name in FIGURES}
    downloads = [figure_downloads("res", figs, session, export)] if export is not None else []
    diff = gr.Dataframe(label="Settings that differ",
                        interactive=False, wrap=True, elem_id="res-settings", visible=False)
    gr.Markdown("Every record's rows below (the record column names it; numbers to 4 significant digits, the CSV "
                "keeps them whole); with one record, the settings table lists all its settings.")
    table = gr.Dataframe(label="Rows of every record", headers=["record", "method"], interactive=False,
                         elem_id="res-table", max_height=600)
    csv = gr.File(label="Rows as CSV", elem_id="res-export")

    def on_open(names, files, runs, sess, request: gr.Request):
        files = [f if isinstance(f, str) else f.name for f in files] if isinstance(files, list) else files
        out = load(names, files, runs, sess, request)
        figures = out["figures"]
        shown = [gr.update(value=figures.get(n), visible=n in figures) for n in FIGURES]
        settings = out["settings"]
        return [out["info"], *shown,
                gr.update(value=settings, visible=settings is not None and len(settings) > 0),
                out["table"], out["csv"], figures] + [None] * len(downloads)  # earlier figure files go

    # defaults of None: API clients may send just the first input (gradio_client reads these defaults)
    def open_shipped(names, files=None, runs=None, sess=None, request: gr.Request = None):
        return on_open(names, files, runs, sess, request)

    def open_upload(files, names=None, runs=None, sess=None, request: gr.Request = None):
        return on_open(names, files, runs, sess, request)

    def open_runs(runs, names=None, files=None, sess=None, request: gr.Request = None):
        return on_open(names, files, runs, sess, request)

    def list_runs():
        return gr.update(choices=local_runs())

    outputs = [info, *[plots[n] for n in FIGURES], diff, table, csv, figs, *downloads]
    # one handler, three orders: each event's first input is its own widget (API clients may name just that one);
    # files are capped in bytes, rows and columns, so four visitors may open records at once
    bundled.change(guard(open_shipped), [bundled, upload, local, session], outputs, api_name="open_shipped",
                   concurrency_limit=4, show_progress_on=[info])
    upload.change(guard(open_upload), [upload, bundled, local, session], outputs, api_name="open_upload",
                  concurrency_limit=4, show_progress_on=[info])
    local.change(guard(open_runs), [local, bundled, upload, session], outputs, api_name="open_runs",
                 concurrency_limit=4, show_progress_on=[info])
    if refresh is not None:
        refresh.click(guard(list_runs), None, [local], api_name=False)
