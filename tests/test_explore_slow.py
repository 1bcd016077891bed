"""Slow tier: the app's plan controls and input checks on the built-in pair's shipped artefacts."""

from __future__ import annotations

import pytest
import torch

from scdviz.app import evict, scd, train
from scdviz.app.inputs import UserError
from scdviz.app.requests import EvictRequest, ScdRequest
from scdviz.scd import calibration, view
from scdviz.scd import plan as plans

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calib(builtin_pair):
    return scd.get_calibration(builtin_pair)


def test_default_controls_are_the_shipped_operating_point(calib):
    plan, op = plans.user_plan(calib), plans.operating_plan(calib)
    assert (plan.modes, plan.rank_k, plan.rank_v, plan.code_bits, plan.code_group) == (
        op.modes, op.rank_k, op.rank_v, op.code_bits, op.code_group)


def test_controls_change_the_plan(calib):
    plan = plans.user_plan(calib, patch_k=0, bits=8, rank_k=32, rank_v=64)
    assert plan.layers_in("patch") == [] and plan.code_bits == 8
    assert set(plan.rank_k) == {32} and set(plan.rank_v) == {64}
    layer = sorted(calib.patches)[0]
    assert plans.user_plan(calib, placement="manual", layers=[layer]).layers_in("patch") == [layer]


def test_bad_controls_get_specific_messages(builtin_pair, calib):
    with pytest.raises(ValueError, match="key rank 999 is out of range"):
        plans.user_plan(calib, rank_k=999)
    missing = next(i for i in range(calib.n_layers) if i not in calib.patches)
    with pytest.raises(ValueError, match=f"no aligner for layer {missing}"):
        plans.user_plan(calib, placement="manual", layers=[missing])
    with pytest.raises(ValueError, match="SCD needs at least"):
        view.window_of(builtin_pair, "too short", 32, 1024)
    with pytest.raises(UserError, match="integers separated by commas"):
        scd.scd_run(builtin_pair, ScdRequest("x " * 100, 32, 8, 4, 0, 0, 0, "manual", "a, b", 10, 0.5))
    with pytest.raises(UserError, match="between 0 and 100"):
        evict.evict_run(builtin_pair, EvictRequest("some context " * 20, "", False, "% kept", 120, "producer", ""))
    with pytest.raises(UserError, match="must be a whole number between 1 and"):
        evict.evict_run(builtin_pair, EvictRequest("some context " * 20, "", False, "tokens kept", 2.5, "producer", ""))
    with pytest.raises(UserError, match="context is empty"):
        evict.evict_run(builtin_pair, EvictRequest(" ", "", False, "% kept", 25, "producer", ""))


def test_a_byte_budget_gets_either_coder_within_it(builtin_pair, calib):
    import dataclasses

    from scdviz import data

    text = data.load_split("jargon", "eval")[5][:1400]
    request = ScdRequest(text, 32, 4, 4, 0, 0, 2, "selected", "", 10, 0.5)
    kls = {}
    for coder, said in (("transform", "transform-coded plan for 2304 B/token"),
                        ("rd", "rate-distortion plan for 2304 B/token")):
        out = scd.scd_run(builtin_pair, dataclasses.replace(request, byte_budget=2304, coder=coder))
        full = out["table"][out["table"]["method"] == "SCD full"].iloc[0]
        assert 2000 < full["bytes_per_token"] <= 2304  # the real payload, a hard limit
        assert said in out["info"]
        plan_fig = scd.scd_figures(out["figures"])["plan"]
        assert {"rank K", "rank V"} <= {trace.name for trace in plan_fig.data}
        assert ("as sent" in plan_fig.layout.title.text) == (coder == "transform")  # ranks follow the data
        kls[coder] = full["kl"]
        with pytest.raises(ValueError, match="below the smallest"):
            scd.scd_run(builtin_pair, dataclasses.replace(request, byte_budget=2, coder=coder))
    assert kls["transform"] < kls["rd"]  # the README's finding holds on this text too
    bare = dataclasses.replace(calib, rate=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scd, "get_calibration", lambda pair, folder=None: bare)
        with pytest.raises(UserError, match="no rate-distortion curves"):
            scd.scd_run(builtin_pair, dataclasses.replace(request, byte_budget=3840))


def test_scd_fan_out_covers_every_specialist(builtin_pair):
    from scdviz import data
    from scdviz.app import webapp as app
    from scdviz.models import builtin

    key = f"{builtin_pair.producer_source}\n{builtin_pair.consumer_source}"
    text = data.load_split("jargon", "eval")[3][:1200]
    out = app.scd_run(key, None, ScdRequest(text, 16, 4, 4, 0, 0, 2, "selected", "", 10.0, 0.5, True))
    table = out["table"]
    assert (set(table["specialist"]) == {f"builtin:{name}" for name in builtin.specialists()}
            >= {"builtin:jargon", "builtin:austen-before"})
    for _, rows in table.groupby("specialist"):
        assert list(rows["method"]) == ["oracle", "raw KV", "4-bit KV", "DroidSpeak recompute", "SCD reuse-only",
                                        "SCD full", "SCD reuse-only (closed form)", "SCD full (closed form)"]
    assert (table[table["method"] == "oracle"]["kl"] == 0).all()


def _key(pair) -> str:
    return f"{pair.producer_source}\n{pair.consumer_source}"


def _last(gen):
    """The last value a heavy job's handler yields (its result)."""
    return list(gen)[-1]


def test_a_loaded_calibration_belongs_to_one_visitor(builtin_pair, tmp_path, monkeypatch):
    """One visitor's calibration never replaces the shipped one for anybody else (hosted or not): the Calibrate
    tab's Load keeps the folder in that visitor's session, and their SCD runs read it from there."""
    import shutil

    from scdviz.app import webapp as app
    from scdviz.app.session import Session

    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    a, b = Session(), Session()
    shutil.copytree(calibration.shipped_folder("builtin:jargon"), tmp_path / "mine")
    md, fig, _ = app.load_calibration(_key(builtin_pair), a, str(tmp_path / "mine"))
    assert md.startswith("Loaded") and fig.data and a.calibrations[("builtin:smollm2-135m", "builtin:jargon")] == \
        tmp_path / "mine" and not b.calibrations
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
    request = ScdRequest(text, 16, 4, 4, 0, 0, 2, "selected", "", 10, 0.5)
    assert "your calibration" in app.scd_run(_key(builtin_pair), a, request)["info"]
    assert "the shipped calibration" in app.scd_run(_key(builtin_pair), b, request)["info"]
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")  # a visitor of a hosted demo names only their own session's runs
    with pytest.raises(UserError, match="does not read local paths"):
        app.load_calibration(_key(builtin_pair), b, str(tmp_path / "mine"))
    shutil.copytree(tmp_path / "mine", b.folder / "runs" / "mine")
    assert app.load_calibration(_key(builtin_pair), b, str(b.folder / "runs" / "mine"))[0].startswith("Loaded")
    assert a.calibrations[("builtin:smollm2-135m", "builtin:jargon")] == tmp_path / "mine"


def test_a_visitor_trains_a_correction_stage_that_only_they_then_use(builtin_pair, tmp_path, monkeypatch):
    """The Calibrate tab's correction stage on the real pair: trained from the shipped calibration (left
    unchanged, read-only), saved in the visitor's run, their SCD calibration from then on (nobody else's);
    its log holds one curve per plan it trained at, and the kept stage is what the saved folder loads."""
    from scdviz.app.requests import DistilRequest

    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    shipped = scd.get_calibration(builtin_pair)
    tag, stage = shipped.tag, {k: {n: t.clone() for n, t in p.items()} for k, p in shipped.corrections.items()}
    req = DistilRequest(train_windows=1, val_windows=1, epochs=2, rank=4, budgets=False, name="mine")
    folder = tmp_path / "mine"
    log = train.distil_for(builtin_pair, req, folder, progress=False)
    mine = calibration.Calibration.load(folder, builtin_pair)
    assert shipped.tag == tag and scd.get_calibration(builtin_pair) is shipped  # the shipped stage, untouched
    assert all(torch.equal(shipped.corrections[k][n], t) for k, p in stage.items() for n, t in p.items())
    assert list(log["val_kl_by_plan"]) == [plans.operating_plan(shipped).name] and len(log["val_kl"]) == 3
    assert log["train_windows"] == log["val_windows"] == len(calibration.domains_of(shipped.config))
    kept = log["best_epoch"] > 0  # else the result is the closed form under its own tag, which mixes with it
    assert (mine.corrections is not None) == kept and (mine.tag != shipped.closed_form().tag) == kept
    assert mine.tag != shipped.tag  # trained again from the closed form: the shipped stage is not the visitor's
    assert scd.get_calibration(builtin_pair, folder).tag == mine.tag


def test_a_recomputed_tail_adds_its_rows_with_their_compute(builtin_pair):
    """The SCD tab's "Recompute the last N prompt tokens": raw KV and SCD reuse-only with the tail beside the
    lineup, their compute share the tail's share of the prefix, lower KL than without it; a tail longer than
    the prompt gets a message naming the limit."""
    from scdviz import data
    from scdviz.app import webapp as app

    key = f"{builtin_pair.producer_source}\n{builtin_pair.consumer_source}"
    text = data.load_split("jargon", "eval")[3][:1200]
    req = ScdRequest(text, 16, 4, 4, 0, 0, 2, "selected", "", 10.0, 0.5, False, recompute_tail=24)
    table = app.scd_run(key, None, req)["table"].set_index("method")
    for base in ("raw KV", "SCD reuse-only"):
        tailed = table.loc[f"{base} + last 24 recomputed"]
        assert tailed["kl"] < table.loc[base, "kl"] and table.loc[base, "prefill_share"] == 0
        assert 0.05 < tailed["prefill_share"] < 0.25  # 24 of the prompt's ~250 tokens
    with pytest.raises(ValueError, match="a recomputed tail is 1 to"):
        app.scd_run(key, None, ScdRequest(text, 16, 4, 4, 0, 0, 2, "selected", "", 10.0, 0.5, False,
                                          recompute_tail=500))


def test_a_visitor_fits_the_distilled_scorer_that_only_they_then_inspect(builtin_pair, tmp_path, monkeypatch):
    """The Calibrate / train tab's distilled scorer on the real pair: fitted on the producer (a heavy job), saved in
    the visitor's run (a file that loads back), one of their eviction methods from then on, whose kept tokens
    they can inspect, and nobody else's."""
    from scdviz import data
    from scdviz.app import webapp as app
    from scdviz.app.jobs import Jobs
    from scdviz.app.requests import FitRequest
    from scdviz.app.session import Session
    from scdviz.evict.student import Student

    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    a, b = Session(), Session()
    md, fig, _ = _last(app.fit(Jobs(), _key(builtin_pair), a, FitRequest(contexts=6, val_contexts=6, window=32,
                                                                         name="mine")))
    assert "added to your eviction methods as `yours:mine`" in md and fig.data and not b.policies
    mine = Student.load(a.policies["yours:mine"])
    assert mine.config.window == 32 and f"Validation KL of the kept candidate {mine.meta['val_kl']:.4f}" in md
    context = " ".join(data.load_split("jargon", "eval")[5].split()[:120])
    request = EvictRequest(context, "", False, "% kept", 25, "producer", "yours:mine", ["ObservedAttention"])
    out = app.evict_run(_key(builtin_pair), a, request)
    assert "yours:mine" in set(out["table"]["method"]) and "yours:mine" in out["methods"]
    kept = [frac for _, frac in out["kept"]]
    assert 0.2 < sum(kept) / len(kept) < 0.3  # a quarter of the context kept, averaged over layers and heads
    assert set(out["figures"]) == {"kl_steps", "sweep", "heatmap", "features"}  # drawn in the server's process
    with pytest.raises(UserError, match="yours:mine"):  # another visitor cannot inspect it
        app.evict_run(_key(builtin_pair), b, request)