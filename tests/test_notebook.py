"""The example notebook runs, cell by cell, on tiny random models (the built-in pair in real use)."""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go
import pytest
from conftest import tiny_folder, user_text

from scdviz.models.pair import load_pair
from scdviz.scd import calibrate as cal
from scdviz.scd import calibration

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "walkthrough.ipynb"


def test_the_example_notebook_runs_and_draws_its_figures(tmp_path, monkeypatch):
    text = user_text()
    producer = tiny_folder(tmp_path / "producer", text)
    consumer = tiny_folder(tmp_path / "consumer", text)  # same tokenizer; its own random weights (seed 0 again)
    pair = load_pair(str(producer), str(consumer))
    calib = cal.calibrate(calibration.CalibConfig(domains=["austen", "gcide"], n_fit=4, n_select=2, prompt_len=48,
                                                  cont_len=8, n_candidates=2, patch_k=1, op_patch_k=1,
                                                  rate_windows=0), pair, progress=False)
    calib.save(tmp_path / "calib")
    for key, value in {"PRODUCER": producer, "CONSUMER": consumer, "CALIBRATION": tmp_path / "calib",
                       "CHARS": 400}.items():
        monkeypatch.setenv(f"SCDVIZ_EXAMPLE_{key}", str(value))
    _check(_run_notebook(tmp_path, monkeypatch))


@pytest.mark.slow
def test_the_example_notebook_runs_on_the_built_in_pair(tmp_path, monkeypatch, builtin_pair):
    for key in ("PRODUCER", "CONSUMER", "CALIBRATION", "CHARS"):
        monkeypatch.delenv(f"SCDVIZ_EXAMPLE_{key}", raising=False)
    namespace = _check(_run_notebook(tmp_path, monkeypatch))
    assert namespace["pair"].consumer_facts.layers == 30


def _run_notebook(tmp_path, monkeypatch) -> dict:
    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] for c in cells), "commit the notebook without outputs"
    namespace: dict = {}
    for cell in cells:
        exec(compile("".join(cell["source"]), f"{NOTEBOOK.name} cell", "exec"), namespace)  # noqa: S102
    return namespace


def _check(namespace: dict) -> dict:
    assert isinstance(namespace["drift"], go.Figure) and isinstance(namespace["sweep"], go.Figure)
    assert len(namespace["drift"].data) >= 3 and len(namespace["sweep"].data) >= 5
    methods = list(namespace["report"].table()["method"])
    assert methods[0] == "oracle" and "SCD full" in methods
    assert {p.suffix for p in namespace["written"]} == {".html"} and all(p.is_file() for p in namespace["written"])
    return namespace
