"""Calibrate / train tab: SCD calibration, its correction stage trained through the consumer, the distilled
scorer (the headline eviction method) fitted, and a DistillCache policy (docs/design.md#training) trained,
for the loaded pair.

Widgets and wiring only; the work arrives from app.py. Progress bars follow the library's
tqdm bars; the training plot updates while the policy trains.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from scdviz.app.requests import CalibrateRequest, DistilRequest, FitRequest, TrainRequest
from scdviz.app.ui import controls
from scdviz.app.ui.common import figure_downloads, guard


def build(calibrate: Callable, load_calibration: Callable, train: Callable, stop: Callable, pair_state: gr.State,
          session: gr.State, export: Callable | None = None, distil: Callable | None = None,
          fit: Callable | None = None) -> None:
    """Add the tab (its controls built from ``CalibrateRequest`` and ``TrainRequest``): ``calibrate(pair_key,
    session, request, http, progress)`` and ``train(...)`` (the same) yield (markdown, figure, session) as they
    run; ``load_calibration(pair_key, session, folder)`` returns them; ``stop(session, what)`` cancels the
    visitor's "calibrate", "distil" or "train" job (its Stop button) and returns a message; ``distil(...)``
    (as ``calibrate``) trains the correction stage of the visitor's calibration, else the shipped one; ``fit(...)``
    (the same) fits the distilled scorer on the producer;
    ``export`` (see ``common.figure_downloads``) offers the tab's two figures as files.

    What a visitor makes or loads lives in their ``session`` (gr.State), never in a global."""
    gr.Markdown("### SCD calibration for the loaded pair\nFits REUSE codes, aligners and the patch order on the "
                "*calib* splits of the chosen domains (shrinkage toward identity and patch gates chosen on held-out "
                "domains); the result becomes *your* calibration for the pair in the SCD tab "
                "(other visitors keep theirs) and is saved as a run named NAME. (Same code as "
                "`python -m scdviz calibrate`; minutes on a CPU.)")
    calibration = controls.build(CalibrateRequest)
    with gr.Row():
        cal_btn, cal_stop = _job_buttons("Calibrate", "cal")
        folder = gr.Textbox(label="…or load a saved calibration folder", elem_id="cal-folder")
        load_btn = gr.Button("Load calibration", elem_id="cal-load")
    cal_info, cal_plot = _summary_and_plot("cal", "Greedy patch selection")

    if distil is not None:
        gr.Markdown("### SCD correction stage, trained through the consumer\nStarts at the calibration above "
                    "(yours, else the shipped one) and trains a low-rank correction of every decoded REUSE layer by "
                    "backpropagation through the frozen consumer on KL(oracle ‖ SCD) of teacher-forced "
                    "continuations, on payloads at the operating point (and at 1/6 and 1/10 of fp16 when the "
                    "calibration has rate curves). Windows come from the *train* splits; the validated point kept "
                    "(after each epoch, or every N steps) is chosen on *calib* windows. The result becomes your "
                    "calibration; the SCD tab then shows every SCD method beside its closed form. (Same code as "
                    "`python -m scdviz distil`.)")
        distilling, dis_btn, dis_stop, dis_info, dis_plot = _job_section(DistilRequest, "Train correction stage",
                                                                         "distil", "Correction stage training")

    if fit is not None:
        gr.Markdown("### Distilled scorer (the headline eviction method)\nA linear scorer per layer and KV head on "
                    "what the layer computes anyway (its input, ‖v‖, position, age and, with a window, the attention "
                    "of the last W queries), fitted in closed form to the attention the text *after* each training "
                    "context pays it (KVzap's recipe on a richer input), then refined by a listwise loss; ridge "
                    "strength and decode-state weight chosen on *calib* contexts against H2O's KL there. Saved as a "
                    "run named NAME and added to your eviction methods. (Same code as `python -m scdviz "
                    "fit-student`; the shipped one used 120 contexts.)")
        fitting, fit_btn, fit_stop, fit_info, fit_plot = _job_section(FitRequest, "Fit scorer", "fit",
                                                                      "Distilled scorer fit")

    gr.Markdown("### DistillCache policy training (the method as designed)\nAn MLP over five attention features per "
                "token, trained by REINFORCE with Gumbel top-B sampling and a leave-one-out baseline on the producer, "
                "after a short warm start. Saved as a run named NAME and added to your eviction methods. "
                "(Same code as `python -m scdviz train-policy`.)")
    buttons = {}

    def add_button(_):
        buttons["train"], buttons["stop"] = _job_buttons("Train", "train")

    training = controls.build(TrainRequest, after={"name": add_button})
    train_info, train_plot = _summary_and_plot("train", "Policy training")
    figs = gr.State({})  # this visitor's figures of the tab, for the download button
    downloads = [figure_downloads("train", figs, session, export)] if export is not None else []

    def with_figure(out, figures, name):
        md, fig, sess = out
        figures = {**(figures or {}), name: fig} if hasattr(fig, "to_dict") else figures  # not a progress update
        return md, fig, sess, figures, *[None] * len(downloads)  # earlier files go

    def on_calibrate(pair_key, session, figures, request: gr.Request, progress=gr.Progress(), **values):  # noqa: B008
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        for out in calibrate(pair_key, session, CalibrateRequest(**values), http=request, progress=progress):
            yield with_figure(out, figures, "patch_selection")

    def on_load(pair_key, session, figures, folder):
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        return with_figure(load_calibration(pair_key, session, folder), figures, "patch_selection")

    def on_train(pair_key, session, figures, request: gr.Request, progress=gr.Progress(), **values):  # noqa: B008
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        for out in train(pair_key, session, TrainRequest(**values), http=request, progress=progress):
            yield with_figure(out, figures, "policy_training")

    def on_fit(pair_key, session, figures, request: gr.Request, progress=gr.Progress(), **values):  # noqa: B008
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        for out in fit(pair_key, session, FitRequest(**values), http=request, progress=progress):
            yield with_figure(out, figures, "scorer_fit")

    def on_distil(pair_key, session, figures, request: gr.Request, progress=gr.Progress(), **values):  # noqa: B008
        if not pair_key:
            raise gr.Error("load a pair first (Pair tab)", print_exception=False)
        for out in distil(pair_key, session, DistilRequest(**values), http=request, progress=progress):
            yield with_figure(out, figures, "correction_training")

    cal_outputs = [cal_info, cal_plot, session, figs, *downloads]
    cal_event = cal_btn.click(guard(on_calibrate), [pair_state, session, figs], cal_outputs,
                              inputs_kwargs=calibration, concurrency_limit=None, api_name="calibrate",
                              show_progress_on=[cal_info])
    load_btn.click(guard(on_load), [pair_state, session, figs, folder], cal_outputs,
                   concurrency_limit=1, api_name="load_calibration", show_progress_on=[cal_info])
    train_event = buttons["train"].click(guard(on_train), [pair_state, session, figs],
                                         [train_info, train_plot, session, figs, *downloads],
                                         inputs_kwargs=training, concurrency_limit=None, api_name="train",
                                         show_progress_on=[train_info])
    if distil is not None:
        dis_event = dis_btn.click(guard(on_distil), [pair_state, session, figs],
                                  [dis_info, dis_plot, session, figs, *downloads], inputs_kwargs=distilling,
                                  concurrency_limit=None, api_name="distil", show_progress_on=[dis_info])
        dis_stop.click(lambda sess: stop(sess, "distil"), [session], [dis_info], cancels=[dis_event], api_name=False,
                       queue=False)
    if fit is not None:
        fit_event = fit_btn.click(guard(on_fit), [pair_state, session, figs],
                                  [fit_info, fit_plot, session, figs, *downloads], inputs_kwargs=fitting,
                                  concurrency_limit=None, api_name="fit", show_progress_on=[fit_info])
        fit_stop.click(lambda sess: stop(sess, "fit"), [session], [fit_info], cancels=[fit_event], api_name=False,
                       queue=False)
    # Stop: the job is told to end at its next step (its files are removed), and the event is cancelled
    cal_stop.click(lambda sess: stop(sess, "calibrate"), [session], [cal_info], cancels=[cal_event], api_name=False,
                   queue=False)
    buttons["stop"].click(lambda sess: stop(sess, "train"), [session], [train_info], cancels=[train_event],
                          api_name=False, queue=False)


def _job_section(request_type, label: str, prefix: str, title: str) -> tuple:
    """A heavy job's controls (built from ``request_type``), its run and Stop buttons, summary and figure."""
    values = controls.build(request_type)
    with gr.Row():
        run, stop = _job_buttons(label, prefix)
    return values, run, stop, *_summary_and_plot(prefix, title)


def _job_buttons(label: str, prefix: str) -> tuple[gr.Button, gr.Button]:
    """A heavy job's run and Stop buttons (``#<prefix>-run``, ``#<prefix>-stop``), in the current row."""
    return (gr.Button(label, variant="primary", elem_id=f"{prefix}-run"),
            gr.Button("Stop", variant="stop", elem_id=f"{prefix}-stop", scale=0, min_width=80))


def _summary_and_plot(prefix: str, title: str) -> tuple[gr.Markdown, gr.Plot]:
    """A job's summary and its figure (``#<prefix>-info``, ``#<prefix>-plot``)."""
    return gr.Markdown(label="Summary", elem_id=f"{prefix}-info"), gr.Plot(label=title, elem_id=f"{prefix}-plot")
