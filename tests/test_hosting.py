"""Hosted mode's rules, input checks and per-session folders (fast tier: no models)."""

from __future__ import annotations

import pytest

from scdviz import runs, settings
from scdviz.app import hosting, inputs, session
from scdviz.app.inputs import UserError
from scdviz.models import builtin

OUTSIDE = ["builtin:/etc", "builtin:../../../..", "builtin:../adapters/jargon", "builtin:jargon/../bible",
           "builtin:", "builtin:JARGON", "builtin:jargon ", "builtin:\x00"]


@pytest.mark.parametrize("source", OUTSIDE)
@pytest.mark.parametrize("hosted", ["0", "1"])
def test_builtin_names_are_looked_up_never_joined(source, hosted, monkeypatch):
    monkeypatch.setenv("SCDVIZ_HOSTED", hosted)
    if source == "builtin:jargon ":  # surrounding blanks are stripped: the shipped name itself
        assert hosting.check_source(source) == ("builtin", "jargon")
        return
    with pytest.raises(UserError, match="unknown built-in model"):
        hosting.check_source(source)


def test_adapter_dir_refuses_paths():
    for name in ("/etc", "..", "../adapters/jargon"):
        with pytest.raises(ValueError, match="unknown built-in specialist"):
            builtin.adapter_dir(name)
    assert builtin.adapter_dir("jargon").parent == builtin.ADAPTERS_DIR


def test_hosted_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    monkeypatch.delenv("SCDVIZ_HUB_ALLOW", raising=False)
    for source in (str(tmp_path), "./models", "~/x", "/etc", "a/b/c", "..\\x", "C:\\models"):
        with pytest.raises(UserError, match="local folders are not available"):
            hosting.check_source(source)
    with pytest.raises(UserError, match="allow-list"):
        hosting.check_source("org/model")
    monkeypatch.setenv("SCDVIZ_HUB_ALLOW", "org/model")
    assert hosting.check_source(" org/model ") == ("hub", "org/model")
    with pytest.raises(UserError, match="'org/other' is not on it"):
        hosting.check_source("org/other")
    assert hosting.check_source("builtin:austen-before") == ("builtin", "austen-before")
    with pytest.raises(UserError, match="at most 300 characters"):
        hosting.check_source("org/" + "x" * 400)


def test_the_app_checks_hosted_rules_before_the_loader(tmp_path, monkeypatch):
    """What the library's loader once refused in hosted mode, the app's check refuses with the same messages."""
    (tmp_path / "adapter_config.json").write_text("{}")
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    monkeypatch.delenv("SCDVIZ_HUB_ALLOW", raising=False)
    with pytest.raises(UserError, match="local folders are not available here"):
        hosting.check_source(str(tmp_path))
    with pytest.raises(UserError, match="allow-list"):
        hosting.check_source("org/model")
    monkeypatch.setenv("SCDVIZ_HUB_ALLOW", "org/model, org/other")
    assert hosting.check_source("org/model")[0] == "hub"


def test_local_sources_when_not_hosted(monkeypatch, tmp_path):
    monkeypatch.setenv("SCDVIZ_HOSTED", "0")
    assert hosting.check_source(str(tmp_path)) == ("local", str(tmp_path))
    assert hosting.check_source("org/model") == ("hub", "org/model")
    with pytest.raises(UserError, match="neither a built-in name"):
        hosting.check_source("no spaces/allowed here!")


def test_probe_hub_fails_fast_offline(monkeypatch):
    import time

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="offline"):
        hosting.probe_hub("nobody-xyz/not-a-model-1234")
    assert time.perf_counter() - t0 < 5


def test_user_paths(monkeypatch, tmp_path):
    inside, outside = tmp_path / "mine", tmp_path / "other"
    inside.mkdir(), outside.mkdir()
    (outside / "r.json").write_text("[]")
    monkeypatch.setenv("SCDVIZ_HOSTED", "0")
    assert hosting.user_folder(str(outside), "calibration folder") == outside.resolve()
    with pytest.raises(UserError, match="is not a folder"):
        hosting.user_folder(str(outside / "r.json"), "calibration folder")
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    for path in (str(outside), str(inside / ".." / "other"), "/etc", "~"):
        with pytest.raises(UserError, match="does not read local paths"):
            hosting.user_folder(path, "calibration folder", roots=(inside,))
    with pytest.raises(UserError, match="does not read local paths"):
        hosting.user_file(str(outside / "r.json"), "benchmark file", roots=(inside,))
    assert hosting.user_folder(str(inside), "calibration folder", roots=(inside,)) == inside.resolve()


@pytest.mark.parametrize("value, message", [
    (None, "is empty"), ("", "is empty"), ("abc", "must be a number"), ("Infinity", "must be between"),
    (float("nan"), "must be between"), (float("inf"), "must be between"), (-1, "must be between"),
    (101, "must be between"), (True, "must be a number"), ([1], "must be a number"), (2.5, "whole number"),
])
def test_integer_checks_name_the_field_and_range(value, message):
    with pytest.raises(UserError, match=message) as err:
        inputs.integer(value, "Widgets", 0, 100)
    assert "Widgets" in str(err.value)


def test_number_and_choice_accept_what_the_ui_sends():
    assert inputs.integer("7", "x", 0, 10) == 7 and inputs.integer(7.0, "x", 0, 10) == 7
    assert inputs.number("2.5", "x", 0, 10) == 2.5
    assert inputs.choice(4, "bits", (4, 8)) == "4"
    assert inputs.flag("true", "f") is True and inputs.flag(0, "f") is False
    with pytest.raises(UserError, match="must be one of 4, 8"):
        inputs.choice(5, "bits", (4, 8))
    with pytest.raises(UserError, match="true or false"):
        inputs.flag("maybe", "f")


@pytest.mark.parametrize("name", ["", " ", ".", "..", "../x", "a/b", "a\\b", ".hidden", "x" * 65, "a b", "é", None])
def test_bad_run_names(name):
    with pytest.raises(UserError, match="run name"):
        runs.run_name(name)


def test_text_is_capped_before_tokenising():
    with pytest.raises(UserError, match="has 5,000,001 characters"):
        inputs.text("x" * 5_000_001, "the prompt", 1000)
    with pytest.raises(UserError, match="must be text"):
        inputs.text(123, "the prompt", 1000)
    assert inputs.text("", "q", 10, required=False) == ""


def test_sessions_are_separate_unique_and_bounded(monkeypatch, tmp_path):
    monkeypatch.setenv("SCDVIZ_CACHE", str(tmp_path))
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    monkeypatch.setenv("SCDVIZ_MAX_SESSION_RUNS", "2")
    a, b = session.Session(), session.Session()
    ra, rb = a.new_run("run", "policies"), b.new_run("run", "policies")  # the same name in two sessions: two folders
    assert ra != rb and ra.is_relative_to(a.folder) and rb.is_relative_to(b.folder)
    with pytest.raises(UserError, match="already exists"):
        a.new_run("run", "policies")
    a.new_run("second", "calibrations")
    with pytest.raises(UserError, match="at most 2 runs"):
        a.new_run("third", "policies")
    (a.scratch() / "x.csv").write_text("1")
    a.close()
    assert not a.folder.exists() and rb.is_dir()
    assert session.clean_stale() == 1 and not b.folder.exists()
    monkeypatch.setenv("SCDVIZ_HOSTED", "0")
    local = session.Session().new_run("kept", "calibrations")
    assert local == settings.cache_dir() / "runs" / "calibrations" / "kept"
    with pytest.raises(UserError, match="already exists"):
        session.Session().new_run("kept", "calibrations")  # another session, same folder: refused, not overwritten


def test_space_front_matter_matches_requirements():
    import re

    import gradio

    readme = (settings.REPO_DIR / "README.md").read_text()
    assert readme.startswith("---\n")
    meta = dict(line.split(": ", 1) for line in readme.split("---\n")[1].splitlines() if ": " in line)
    pinned = re.search(r"^gradio==([\w.]+)$", (settings.REPO_DIR / "requirements.txt").read_text(), re.M)
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py" and (settings.REPO_DIR / "app.py").is_file()
    assert pinned and meta["sdk_version"] == pinned.group(1) == gradio.__version__
    assert meta["suggested_hardware"]


def test_every_gpu_call_asks_for_a_duration_sized_by_its_request_and_launch_honours_gradio_env(monkeypatch):
    """With the Spaces package present, each GPU call (and only those: loading a pair, figures and exports run in
    the server's process) is a generator wrapped with a duration its request sizes, within ZeroGPU's limit."""
    import importlib
    import inspect
    import sys
    import types

    from scdviz.app import gpu as gpu_module
    from scdviz.app import requests as R

    asked = {}

    def decorator(duration):
        def wrap(fn):
            assert inspect.isgeneratorfunction(fn), fn.__name__  # its progress and result cross as values
            asked[fn.__name__] = duration
            return fn

        return wrap

    monkeypatch.setitem(sys.modules, "spaces", types.SimpleNamespace(GPU=decorator))
    gpu = importlib.reload(gpu_module)
    try:
        assert set(asked) == {"generate", "scd", "evict", "calibrate", "distil", "check_calibration", "fit", "train"}
        small_large = {
            "generate": (R.GenerateRequest(new_tokens=4), R.GenerateRequest(new_tokens=256)),
            "scd": (R.ScdRequest(continuation_tokens=8, generated_tokens=4), R.ScdRequest()),
            "evict": (R.EvictRequest(methods=["h2o"], generated_tokens=4), R.EvictRequest(methods=["h2o"] * 20)),
            "calibrate": (R.CalibrateRequest(fit_windows=4), R.CalibrateRequest(fit_windows=64)),
            "distil": (R.DistilRequest(epochs=1, train_windows=1), R.DistilRequest(epochs=6, train_windows=30)),
            "fit": (R.FitRequest(contexts=6, val_contexts=6), R.FitRequest(contexts=60, val_contexts=24)),
            "train": (R.TrainRequest(steps=5), R.TrainRequest(steps=300)),
        }
        for name, (small, large) in small_large.items():
            low, high = asked[name]("key", small), asked[name]("key", large)
            assert 20 <= low < high <= gpu.MAX_SECONDS, (name, low, high)
        one = asked["scd"]("key", R.ScdRequest())
        assert asked["scd"]("key", R.ScdRequest(), None, fan_out=2) == min(2 * one, gpu.MAX_SECONDS)
        assert 0 < asked["check_calibration"]("key", "folder") <= 60
        from scdviz.app import webapp as app

        assert "server_name" not in app.launch_kwargs() and "server_port" not in app.launch_kwargs()
        assert app.launch_kwargs()["max_file_size"] == f"{settings.max_upload_mb()}mb"
    finally:
        monkeypatch.delitem(sys.modules, "spaces")
        importlib.reload(gpu_module)


def test_a_page_key_names_the_session_folder_and_cannot_escape(monkeypatch, tmp_path):
    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path))
    s = session.Session().bind("../../etc")  # a client chooses its session hash: it is hashed, never joined
    assert s.folder.parent == session.sessions_root() and s.folder.name == session.folder_id("../../etc")
    (s.scratch() / "results.csv").write_text("1")
    assert s.bind("another-key").folder.name == session.folder_id("../../etc")  # never renamed once written
    session.remove_folder_of("../../etc")
    assert not s.folder.exists() and tmp_path.is_dir()


def test_hosted_mode_loads_only_shipped_models_and_never_names_others(monkeypatch):
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    for source in (f"builtin:{builtin.GEMMA_NAME}", "builtin:nope"):
        with pytest.raises(UserError) as err:
            hosting.check_source(source)
        assert builtin.GEMMA_NAME not in str(err.value).replace(source, "")  # the refusal does not offer it
        assert "builtin:jargon" in str(err.value)
    monkeypatch.setenv("SCDVIZ_HOSTED", "0")
    assert hosting.check_source(f"builtin:{builtin.GEMMA_NAME}") == ("builtin", builtin.GEMMA_NAME)


@pytest.mark.parametrize("where", ["text", "source", "path"])
def test_a_lone_surrogate_is_refused_by_name(where, monkeypatch):
    bad = "hello \udc80 world"
    with pytest.raises(UserError, match=r"not valid Unicode text .* at position (6|14)"):
        if where == "text":
            inputs.text(bad, "the prompt", 100)
        elif where == "source":
            hosting.check_source("builtin:" + bad)
        else:
            hosting.user_file(bad, "benchmark file")


def test_a_fixed_text_limit_does_not_cite_the_prompt_setting():
    from scdviz.app.requests import ScdRequest

    control = ScdRequest.controls()["manual_layers"]
    with pytest.raises(UserError) as err:
        control.check("1," * 150)
    assert "at most 200" in str(err.value) and "SCDVIZ_MAX_PROMPT_CHARS" not in str(err.value)
    with pytest.raises(UserError, match="SCDVIZ_MAX_PROMPT_CHARS"):
        ScdRequest.controls()["text"].check("x" * (settings.max_prompt_chars() + 1))


def test_hosted_eviction_requests_are_capped_before_any_gpu_time(monkeypatch):
    """Hosted mode: at most SCDVIZ_HOSTED_METHODS methods and SCDVIZ_HOSTED_CONTEXT_TOKENS tokens per eviction
    request (all 25 methods on a 1,020-token context held the worker 147 s), refused by name; local use is free."""
    from scdviz.app import evict
    from scdviz.app.requests import EvictRequest
    from scdviz.evict import bench

    def words(text, add_special_tokens=False):
        return {"input_ids": text.split()}

    many = EvictRequest("word " * 50, methods=bench.method_names()[:7])
    long = EvictRequest("word " * 700, methods=bench.method_names()[:2])
    evict.hosted_cost(words, many)  # local use: nothing refused
    evict.hosted_cost(words, long)
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    with pytest.raises(UserError, match="compares at most 6 eviction methods per request .SCDVIZ_HOSTED_METHODS. "
                                        "and 7 are ticked"):
        evict.hosted_cost(words, many)
    with pytest.raises(UserError, match="have 700 tokens together; this hosted demo evicts from at most 600"):
        evict.hosted_cost(words, long)
    evict.hosted_cost(words, EvictRequest("word " * 50))  # the focused set, a short context: accepted
    monkeypatch.setenv("SCDVIZ_HOSTED_METHODS", "8")
    evict.hosted_cost(words, many)


def test_a_hosted_cpu_server_refuses_fitting_the_scorer_before_any_work(monkeypatch, tiny_pair):
    from scdviz.app import train

    monkeypatch.setenv("SCDVIZ_HOSTED", "0")
    train.hosted_fit(tiny_pair)  # a local install fits wherever its pair sits
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    with pytest.raises(UserError, match="runs on a CPU, where fitting the distilled scorer takes minutes"):
        train.hosted_fit(tiny_pair)
    import torch

    from scdviz.models import hf

    monkeypatch.setattr(hf, "device_of", lambda model: torch.device("cuda"))
    train.hosted_fit(tiny_pair)  # a GPU host fits, at the hosted caps
