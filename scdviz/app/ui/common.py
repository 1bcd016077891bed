"""Shared UI helpers: turn library errors into messages a person can act on."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import gradio as gr

from scdviz import settings

log = logging.getLogger("scdviz.ui")

# Plots drawn while their tab was hidden keep the width they were drawn at; gradio's plotly plots
# follow window resizes, so a tab that opens sends one.
RESIZE_JS = "() => { setTimeout(() => window.dispatchEvent(new Event('resize')), 50); }"


def redraw_on_select(tab) -> None:
    """Fit the plots of ``tab`` (a gr.Tab) to their width whenever it is opened (client side only)."""
    tab.select(None, None, None, js=RESIZE_JS, queue=False, api_name=False)


def guard(fn, duration: float | None = 10):
    """Wrap a handler so user errors show as a message and nothing shows a traceback.

    ValueError (UserError, PairError, bad ranges) keeps its own message; anything else is
    logged on the server with its traceback and reported to the user in one line. ``duration``:
    seconds the message stays on screen (None: until the person closes it).
    """

    def translate(err: Exception) -> gr.Error:
        if isinstance(err, gr.Error):
            return err
        if isinstance(err, ValueError):
            return gr.Error(str(err), duration=duration, print_exception=False)
        log.exception("handler %s failed", fn.__name__)
        return gr.Error(f"internal error ({type(err).__name__}): {err}", duration=duration, print_exception=False)

    if inspect.isgeneratorfunction(fn):  # streaming handlers (live plots)

        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - the server must survive any handler failure
                raise translate(err) from None

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - the server must survive any handler failure
            raise translate(err) from None

    return wrapper


def reporter(progress):
    """A library reporter (``scdviz.progress``: ``report(desc, done, total)``) that moves a gr.Progress."""
    def report(desc: str, done: int, total: int) -> None:
        progress((done, total or None), desc=desc)
    return report


def show_on_open(demo: gr.Blocks, first: Callable, shown: Callable, outputs: list, info) -> None:
    """When a page opens, fill a tab's ``outputs`` with ``shown(first())``, the analysis ``first`` computes once per
    server (nothing when it gives None); its progress shows on ``info``."""
    def on_open():
        out = first()
        return shown(out) if out is not None else [gr.skip()] * len(outputs)

    demo.load(guard(on_open), None, outputs, api_name=False, show_progress_on=[info])


def diff_tokens(tokens: list[str], reference: list[str], label: str = "differs") -> list[tuple[str, str | None]]:
    """(text, label) pairs for gr.HighlightedText: tokens that differ from the reference at the same position."""
    return [(tok, None if i < len(reference) and reference[i] == tok else label) for i, tok in enumerate(tokens)]


def figure_downloads(prefix: str, figs: gr.State, session: gr.State, export: Callable,
                     name: str | None = None, static: bool | None = None) -> gr.File:
    """A "Download figures" button for a tab (element ids ``<prefix>-figs-btn``, ``<prefix>-figs``,
    ``<prefix>-figs-static``): ``export(figures, session, name, http, static)`` (``http``: the gr.Request)
    writes the tab's current figures (held in ``figs``, so no model work runs again) into the visitor's
    session folder as one HTML page and, when the box is ticked, PNG and SVG zips; the files are offered
    below the button. Hosted mode (``static`` None: as the settings say) offers no box."""
    static = not settings.hosted() if static is None else static
    with gr.Row():
        with gr.Column(scale=1, min_width=260):
            button = gr.Button("Download these figures", elem_id=f"{prefix}-figs-btn")
            images = gr.Checkbox(False, label="also PNG and SVG (zips; starts Chromium, seconds more)",
                                 visible=static, elem_id=f"{prefix}-figs-static")
            gr.Markdown("One HTML page holds every figure and opens offline (plotly.js inside once); each plot's "
                        "camera button saves it as PNG.")
        files = gr.File(label="Figures", file_count="multiple", interactive=False, elem_id=f"{prefix}-figs", scale=3,
                        height=200)

    def download_figures(current, sess, with_images, request: gr.Request):
        return export(current, sess, name or prefix, request, bool(with_images))

    button.click(guard(download_figures), [figs, session, images], [files], api_name=f"{prefix}_figures",
                 concurrency_limit=1)
    return files
