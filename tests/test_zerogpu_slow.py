"""The hosted app under ZeroGPU's rules, walked tab by tab as a visitor does (issue 59): every GPU call runs in a
forked worker with pickled arguments and results (tests/zerogpu/spaces: a stand-in for the ``spaces`` package
that does what ZeroGPU's does), so nothing made inside one call reaches the server except what it returns.

One real app (``python app.py``, hosted mode, the built-in pair on the CPU), one visitor (gradio_client):
load, generate, SCD, eviction, calibrate then SCD with that calibration, train then eviction with that
policy, Stop, and figure export, with no error and each GPU call's duration sized by its request."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from apprunner import REPO, running_app

pytestmark = pytest.mark.slow

P, J = "builtin:smollm2-135m", "builtin:jargon"
CTX = ("The quick brown fox jumps over the lazy dog while the farmer watches from the gate and the children "
       "laugh in the orchard under the old apple trees. ") * 4
TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. The hallway smelt of boiled "
        "cabbage and old rag mats. At one end of it a coloured poster, too large for indoor display, had been "
        "tacked to the wall. ") * 3


def _scd(client, text=TEXT):
    return client.predict(text, 16, 4, "4", 0, 0, 2, "selected", "", 10, 0.5, False, 0, "transform", 0,
                          api_name="/scd_transfer")


def _evict(client, method, methods):
    return client.predict(CTX, "", False, "% kept", 25, "producer", method, methods, 8, 4, api_name="/evict")


@pytest.fixture(scope="module")
def zerogpu_app(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zerogpu")
    log = folder / "gpu-calls.jsonl"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "zerogpu"), str(REPO)]), "SPACES_ZERO_GPU": "true",
           "SPACES_STANDIN_LOG": str(log), "SCDVIZ_HOSTED": "1", "SCDVIZ_WORK": str(folder / "work"),
           "SCDVIZ_MAX_SESSION_RUNS": "10", "SCDVIZ_DEVICE": "cpu"}
    with running_app(folder / "app.log", **env) as url:
        yield {"url": url, "calls": log, "work": folder / "work", "log": folder / "app.log"}


def _calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_visitor_walks_every_tab_under_zerogpu(zerogpu_app):
    from gradio_client import Client

    assert "ZeroGPU: preloaded" in zerogpu_app["log"].read_text()  # the fixed models load at start
    # a browser waits for Stop's answer until the running step ends; the client's default 5 s would not
    client = Client(zerogpu_app["url"], verbose=False, httpx_kwargs={"timeout": 120})
    summary, _facts = client.predict(P, J, api_name="/load_pair")[:2]
    assert "Compatible" in summary
    assert not _calls(zerogpu_app["calls"])  # loading a pair is no GPU call

    md, producer, consumer = client.predict("Once upon a time", 8, False, api_name="/generate")
    assert "Prompt:" in md and producer and consumer

    shipped = _scd(client)
    assert "the shipped calibration" in shipped[0] and "SCD full" in str(shipped[1])

    ev = _evict(client, "distilled-scorer", ["distilled-scorer", "ObservedAttention"])
    assert ev[0].startswith("distilled-scorer: keeps")

    cal = client.predict(["jargon"], 4, 1, 0, 1, "4", "zg-calibration", api_name="/calibrate")
    assert "Calibrated in" in cal[0], cal[0]
    mine = _scd(client)
    assert "your calibration" in mine[0]  # made in one GPU call, used in the next

    trained = client.predict(5, 2, True, "zg-policy", api_name="/train")
    assert trained[0].startswith("Done: 5 steps"), trained[0]
    ev = _evict(client, "yours:zg-policy", ["ObservedAttention"])
    assert ev[0].startswith("yours:zg-policy: keeps"), ev[0]  # its policy, trained in another worker

    # Stop: the visitor cancels a training; its worker stops and its run folder goes
    job = client.submit(10, 2, True, "zg-stopped", api_name="/train")  # hosted caps: the longest training
    deadline = time.time() + 120
    runs = list(zerogpu_app["work"].glob("sessions/*/runs/policies/zg-stopped"))
    while not runs and time.time() < deadline:
        time.sleep(0.5)
        runs = list(zerogpu_app["work"].glob("sessions/*/runs/policies/zg-stopped"))
    assert runs, "the training never started"
    time.sleep(3)
    job.cancel()
    while runs[0].exists() and time.time() < deadline:
        time.sleep(0.5)
    assert not runs[0].exists(), "the stopped training's run folder was not removed"
    again = client.predict(5, 2, True, "zg-after-stop", api_name="/train")  # its heavy-job slot is free again
    assert again[0].startswith("Done: 5 steps"), again[0]

    files = client.predict(False, api_name="/scd_figures")
    assert any(str(f).endswith(".html") for f in (files if isinstance(files, list) else [files]))

    calls = _calls(zerogpu_app["calls"])
    assert {c["fn"] for c in calls} >= {"generate", "scd", "evict", "calibrate", "train"}
    assert all(20 <= c["duration"] <= 300 for c in calls)
    assert "ZeroGPU worker error" not in zerogpu_app["log"].read_text()
