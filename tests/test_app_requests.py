"""One request dataclass per tab: its fields build the widgets, check the values and name the API (fast: no models)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import gradio as gr
import pandas as pd
import pytest

from scdviz.app import requests
from scdviz.app.inputs import UserError, control
from scdviz.app.requests import ScdRequest


@dataclass
class _WithKnob(ScdRequest):
    """The SCD request with one more control, as a maintainer would add it: one field."""

    knob_level: int = control(3, "Knob level", "int", lo=0, hi=9, step=1)


def _labels(demo: gr.Blocks) -> dict[str, gr.components.Component]:
    return {b.label: b for b in demo.blocks.values() if isinstance(b, gr.components.Component) and b.label}


def test_scd_tab_is_built_from_the_request_and_its_handler_gets_values_by_name():
    from scdviz.app.ui import scd_tab

    got = []

    def run(pair_key, session, request, progress=None):
        got.append((pair_key, session, request))
        return {"info": "ok", "table": pd.DataFrame({"method": ["oracle"]}), "texts": [("oracle", ["a"])],
                "figures": dict.fromkeys(scd_tab.FIGURES)}

    with gr.Blocks() as demo:
        state = gr.State("")
        scd_tab.build(run, ["an example window"], state, state, request_type=_WithKnob)
    labels = _labels(demo)
    controls = _WithKnob.controls()
    assert list(controls) == [f.name for f in fields(_WithKnob)] and "knob_level" in controls
    for name, c in controls.items():  # every field has its widget, with its label and default
        assert c.label in labels, name
    assert labels["Knob level"].value == 3 and labels["Knob level"].maximum == 9
    assert labels["Text (prompt + continuation)"].value == "an example window"  # the tab's own default
    (dep,) = [d for d in demo.fns.values() if d.api_name == "scd_transfer"]
    params = [p["parameter_name"] for p in demo.get_api_info()["named_endpoints"]["/scd_transfer"]["parameters"]]
    assert params == list(controls)  # the API's parameters are the field names, in field order
    values = {name: getattr(_WithKnob(text="a text"), name) for name in controls} | {"knob_level": 7, "rank_k": 16}
    dep.fn("the pair", "the session", progress=lambda *a, **k: None, **values)
    ((pair_key, session, request),) = got
    assert (pair_key, session) == ("the pair", "the session")
    assert isinstance(request, _WithKnob) and request.knob_level == 7 and request.rank_k == 16
    assert request.text == "a text"


def test_every_tab_request_declares_each_control_once_and_checks_it_from_there():
    for cls in (requests.GenerateRequest, requests.ScdRequest, requests.EvictRequest, requests.CalibrateRequest,
                requests.TrainRequest):
        assert [f.name for f in fields(cls)] == list(cls.controls()), cls  # every field is a control
    ok = ScdRequest(text="some text", bits="8", rank_k=16.0).checked()
    assert ok.bits == 8 and ok.rank_k == 16 and isinstance(ok.rank_k, int)  # converted as declared
    with pytest.raises(UserError, match="Continuation tokens scored must be between 8 and 64"):
        ScdRequest(text="x", continuation_tokens=3).checked()
    with pytest.raises(UserError, match="r_K must be a whole number"):
        ScdRequest(text="x", rank_k=12.5).checked()
    with pytest.raises(UserError, match="All built-in specialists must be true or false"):
        ScdRequest(text="x", fan_out="maybe").checked()
    with pytest.raises(UserError, match="the text is empty"):
        ScdRequest().checked()
    with pytest.raises(UserError, match="Calibration domains: choose at least 1"):
        requests.CalibrateRequest(domains=[]).checked()
    # its range is the unit's: the tab checks
    assert requests.EvictRequest(context="c", budget="abc").checked().budget == "abc"
    with pytest.raises(ValueError, match="unknown control kind"):
        control(0, "Bad", "float")


def test_the_api_names_endpoints_and_parameters_in_words_and_hides_internal_ones():
    from scdviz.app import webapp

    demo = webapp.build_demo()
    info = demo.get_api_info()["named_endpoints"]
    assert {"/load_pair", "/generate", "/scd_transfer", "/evict", "/calibrate", "/load_calibration", "/distil",
            "/train"} <= set(info)
    for endpoint, cls in (("/scd_transfer", requests.ScdRequest), ("/evict", requests.EvictRequest),
                          ("/generate", requests.GenerateRequest), ("/calibrate", requests.CalibrateRequest),
                          ("/distil", requests.DistilRequest), ("/train", requests.TrainRequest)):
        params = info[endpoint]["parameters"]
        assert [p["parameter_name"] for p in params] == [f.name for f in fields(cls)], endpoint
        for p in params:  # integer controls are typed int for a script user
            if cls.controls()[p["parameter_name"]].kind == "int":
                assert p["python_type"]["type"] == "int", (endpoint, p["parameter_name"])
    assert [p["parameter_name"] for p in info["/load_pair"]["parameters"]] == ["producer", "consumer"]
    assert [p["parameter_name"] for p in info["/load_calibration"]["parameters"]] == ["folder"]
    listed = set(demo.get_api_info(all_endpoints=True)["named_endpoints"])
    assert "/open_session" not in listed and "/scd" not in listed
    internal = [d for d in demo.fns.values()
                if d.fn is not None and d.fn.__name__ in ("open_session", "on_page_closed")]
    assert len(internal) == 2 and all(d.api_visibility == "private" for d in internal)


def test_code_bits_accept_what_the_api_documents():
    bits = requests.ScdRequest.controls()["bits"]
    assert bits.check("4") == 4 and bits.check(8) == 8 and bits.check(16.0) == 16
    with pytest.raises(UserError, match="must be one of 4, 8, 16"):
        bits.check("5")


def test_the_distil_request_offers_exactly_distils_recall_targets():
    """The Calibrate tab's recall-target choice sends the values DistilConfig accepts, no other."""
    from scdviz.scd import distil

    assert tuple(value for _, value in requests.RECALL_TARGETS) == distil.RECALL_TARGETS
    assert requests.DistilRequest().recall_target in distil.RECALL_TARGETS
    assert requests.DistilRequest().recall == distil.DistilConfig().recall  # the shipped recipe's share


def test_the_method_inspected_by_default_is_the_shipped_cheap_student_in_the_focus_set():
    """The eviction tab inspects the cheap pick of the focused comparison by default; a default outside the
    focus set would make the default request fail ("not among the methods compared")."""
    from scdviz.evict import bench

    assert requests.HEADLINE_SCORER == bench.cheap_on_validation((), bench.EvalConfig().question_len)
    assert requests.HEADLINE_SCORER in bench.focus_methods()
    assert requests.EvictRequest.__dataclass_fields__["method"].default == requests.HEADLINE_SCORER


def test_the_committed_controls_stub_is_what_gradio_writes(tmp_path):
    """gradio writes ``controls.pyi`` beside a module that defines a component (WholeSlider) when it finds none,
    and afterwards rewrites only the class's part: the stub is committed (so the app never writes into its
    package) and must be, byte for byte, what gradio writes for today's controls.py (regenerate: delete it and
    import the app once, or copy what this test's subprocess wrote)."""
    import os
    import shutil
    import subprocess
    import sys

    from scdviz import settings
    from scdviz.app.ui import controls

    source = Path(controls.__file__)
    (tmp_path / "stubcheck").mkdir()
    shutil.copy(source, tmp_path / "stubcheck" / "controls.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(settings.REPO_DIR)])}
    subprocess.run([sys.executable, "-c", "import stubcheck.controls"], cwd=tmp_path, env=env, check=True,
                   timeout=300)
    written = (tmp_path / "stubcheck" / "controls.pyi").read_text(encoding="utf-8")
    assert source.with_suffix(".pyi").read_text(encoding="utf-8") == written


def test_hosted_caps_bound_the_heavy_jobs_and_the_widgets_show_them(monkeypatch):
    from scdviz import data
    from scdviz.app.ui import controls

    req = requests.CalibrateRequest(domains=["jargon"], fit_windows=8, select_windows=1)
    monkeypatch.setenv("SCDVIZ_HOSTED", "0")
    assert req.checked().fit_windows == 8  # a local install: the control's own limits
    assert len(requests.CalibrateRequest(select_windows=1).checked().domains) == len(data.corpora())
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    with pytest.raises(UserError, match=r"this hosted demo takes Windows for the fits up to 4, got 8.*up to 64"):
        req.checked()
    with pytest.raises(UserError, match="at most 1 Calibration domains per request and 2 are chosen"):
        requests.CalibrateRequest(domains=["jargon", "austen"], fit_windows=4, select_windows=1,
                                  rate_windows=0).checked()
    with pytest.raises(UserError, match="must be between 4 and 4"):  # below the floor: the limits in force
        requests.CalibrateRequest(domains=["jargon"], fit_windows=2, select_windows=1, rate_windows=0).checked()
    ok = requests.CalibrateRequest(fit_windows=4, select_windows=1, rate_windows=0).checked()
    assert ok.domains == data.corpora()[:1]  # the default: as many as the hosted demo takes
    c = requests.CalibrateRequest.controls()
    slider = controls.widget(c["fit_windows"], 16)
    assert (slider.maximum, slider.value) == (4, 4)  # the visitor sees the cap, and a default above it lowered
    assert controls.widget(c["domains"], None).value == data.corpora()[:1]
    fixed = controls.widget(c["select_windows"], 4)  # a cap at the control's floor: one value, not offered
    assert isinstance(fixed, gr.Number) and fixed.value == 1 and not fixed.interactive


def test_a_stopped_correction_fit_asked_for_again_resumes_in_the_same_work_folder(monkeypatch):
    """The fit's checkpoint folder is the visitor's, one per pair, base calibration and settings: the same ask
    under another name finds it (so it resumes), other settings, another pair or another visitor do not; and the
    time left is shown once the current step has moved, from its own pace."""
    from scdviz.app import session, webapp
    from scdviz.progress import Step

    a, b = session.Session(), session.Session()
    req = requests.DistilRequest(name="one")
    work = webapp.work_folder(a, "distil", "p\nc", None, req)
    assert work.parent.parent == a.folder  # inside the visitor's own folder
    assert webapp.work_folder(a, "distil", "p\nc", None, requests.DistilRequest(name="two")) == work
    assert webapp.work_folder(a, "distil", "p\nc", None, requests.DistilRequest(epochs=3)) != work
    assert webapp.work_folder(a, "distil", "p\nd", None, req) != work
    assert webapp.work_folder(a, "distil", "p\nc", "/runs/mine", req) != work
    assert webapp.work_folder(b, "distil", "p\nc", None, req).name == work.name != ""  # same recipe, another folder
    assert webapp.work_folder(b, "distil", "p\nc", None, req).parent != work.parent
    fit = webapp.work_folder(a, "fit", "p\nc", None, requests.FitRequest(name="one"))
    assert fit.parent.name == "fit-work" and fit.parent.parent == a.folder  # the scorer's fits: a folder of their own
    assert webapp.work_folder(a, "fit", "p\nc", None, requests.FitRequest(name="two")) == fit
    assert webapp.work_folder(a, "fit", "p\nc", None, requests.FitRequest(contexts=18)) != fit
    clock = iter([0.0, 10.0, 20.0, 30.0, 40.0])
    monkeypatch.setattr(webapp.time, "monotonic", lambda: next(clock))
    pace = webapp.Pace()
    assert pace.eta(Step("steps", 10, 110)) == ""  # first seen: no pace yet
    assert pace.eta(Step("steps", 20, 110)) == ", about 90 s left"  # 10 steps in 10 s, 90 to go
    assert pace.eta(Step("steps", 30, 110)) == ", about 80 s left"  # 20 in 20 s, 80 to go
    assert pace.eta(Step("steps", 31, 1000)) == ", about 23 min left"  # 21 in 30 s, 969 to go: 1384 s
    assert pace.eta(Step("validation", 0, 6)) == ""  # a new step starts its own pace


def test_the_scorer_fit_keeps_its_checkpoint_until_the_scorer_is_saved(monkeypatch, tmp_path):
    """The Calibrate tab's scorer fit runs in the visitor's work folder: a fit that stops (any exception) leaves its
    checkpoint there for the same ask to resume from; one that ends saves the scorer and removes the folder."""
    from scdviz.app import train
    from scdviz.evict import student_fit
    from scdviz.evict.student import Student, StudentConfig

    work, seen = tmp_path / "fit-work" / "abc", []

    def stopped(cfg, pair, progress=True, folder=None):
        seen.append(folder)
        (Path(folder) / "checkpoint.json").parent.mkdir(parents=True, exist_ok=True)
        (Path(folder) / "checkpoint.json").write_text("{}")
        raise KeyboardInterrupt  # what a Stop raises inside the fit

    monkeypatch.setattr(student_fit, "fit", stopped)
    with pytest.raises(KeyboardInterrupt):
        train.fit_scorer(None, requests.FitRequest(), tmp_path / "out", False, work)
    assert seen == [work] and (work / "checkpoint.json").is_file()  # kept for the next ask

    def done(cfg, pair, progress=True, folder=None):
        seen.append(folder)
        student = Student(2, 3, 8, StudentConfig(window=cfg.student.window))
        student.log, student.meta = {"rows": 1}, {"val_kl": 0.1}
        return student

    monkeypatch.setattr(student_fit, "fit", done)
    log = train.fit_scorer(None, requests.FitRequest(), tmp_path / "out", False, work)
    assert seen == [work, work] and not work.exists() and log["kept"] == {"val_kl": 0.1}
    assert (tmp_path / "out").is_dir() and any((tmp_path / "out").iterdir())
