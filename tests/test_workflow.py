"""A researcher's own text through the CLI, end to end, on a tiny model: finetune -> pair-info ->
calibrate -> bench scd / evict -> figures, everything under the runs folder and nothing in the
repository; a bench rerun from its saved config gives the same quality numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_folder, user_text

from scdviz import cli, config, data, records, runs, settings

TIMING = ("ovh", "overhead", "speed", "seconds", "_ms", "ms_", "throughput", "tokens_per_s")


def _assets_state() -> dict:
    return {str(p): p.stat().st_mtime_ns for p in settings.ASSETS_DIR.rglob("*") if p.is_file()}


@pytest.fixture
def flow(tmp_path, monkeypatch):
    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    text = tmp_path / "my.txt"
    text.write_text(user_text())
    return tmp_path, str(tiny_folder(tmp_path / "tiny", text.read_text())), str(text)


def test_a_users_text_splits_into_disjoint_train_calib_eval(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(user_text(23))
    splits = {s: data.text_split(text, s) for s in data.SPLITS}
    assert [len(splits[s]) for s in data.SPLITS] == [15, 4, 4]  # passage i % 5: 0-2 train, 3 calib, 4 eval
    assert sorted(sum(splits.values(), [])) == sorted(data.read_passages(text))
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "eval.txt").write_text("one\n\ntwo")
    assert data.text_split(folder, "eval") == ["one", "two"]
    with pytest.raises(ValueError, match="no calib.txt"):
        data.text_split(folder, "calib")
    with pytest.raises(ValueError, match="too few passages"):
        (tmp_path / "short.txt").write_text("only one passage")
        data.text_split(tmp_path / "short.txt", "eval")


def test_own_text_goes_through_every_command_without_touching_the_repository(flow, capsys):
    root, tiny, text = flow
    before = _assets_state()
    assert cli.main(["finetune", "--base", tiny, "--texts", text, "--steps", "4", "--seq-len", "64", "--batch", "2",
                     "--rank", "4", "--lr", "0.05", "--name", "mine"]) == 0
    spec = runs.root() / "specialists" / "mine"
    assert (spec / "adapter_model.safetensors").is_file() and (spec / "config.toml").is_file()
    info = json.loads((spec / "run.json").read_text())
    assert info["settings"]["finetune"]["texts"] == text and info["seed"] == 0 and info["seconds"] >= 0
    assert {"git_commit", "hardware", "torch"} <= set(info["versions"])
    report = root / "drift.json"
    assert cli.main(["pair-info", "--producer", tiny, "--consumer", str(spec), "--eval", "--texts", text, "--limit",
                     "2", "--prompt-len", "48", "--cont-len", "8", "--out", str(report)]) == 0
    assert list(json.loads(report.read_text())["corpora"]) == ["texts"]  # measured on the user's eval split
    assert cli.main(["calibrate", "--producer", tiny, "--consumer", str(spec), "--texts", text, "--n-fit", "4",
                     "--n-select", "2", "--prompt-len", "48", "--cont-len", "8",
                     "--n-candidates", "2", "--patch-k", "1", "--op-patch-k", "1", "--rate-windows", "0"]) == 0
    calib = runs.root() / "calibrations" / "mine"
    assert (calib / "calibration.safetensors").is_file() and (calib / "run.json").is_file()
    figs = root / "figs"
    assert cli.main(["bench", "scd", "--producer", tiny, "--consumers", str(spec), "--texts", text, "--limit", "2",
                     "--prompt-len", "48", "--cont-len", "8", "--gen-tokens", "4", "--name", "s1",
                     "--figures", str(figs)]) == 0
    assert "calibration of" in capsys.readouterr().out  # the user's calibration was found in the runs folder
    record = records.read(runs.root() / "bench" / "s1" / "record.json")
    assert record.kind == "scd" and record.settings["calibs"] == [] and record.seconds is not None
    assert {r.get("domain") for r in record.rows if r.get("row") == "measured"} == {"texts"}
    made = {p.suffix for p in figs.iterdir()}
    assert made == {".png", ".svg", ".html"}
    assert all(p.stat().st_size > 1000 for p in figs.iterdir())
    assert _assets_state() == before


def test_a_bench_rerun_from_its_saved_config_reproduces_its_quality_numbers(flow):
    root, tiny, text = flow
    args = ["bench", "evict", "--models", tiny, "--texts", text, "--limit", "2", "--context-len", "64", "--cont-len",
            "8", "--question-len", "4", "--keeps", "0.25", "--token-budgets",
            "--no-natives"]
    assert cli.main([*args, "--name", "first"]) == 0
    saved = runs.root() / "bench" / "first" / "config.toml"
    assert "[eval]" in saved.read_text() and "name" not in saved.read_text().split("[eval]")[0].split("\n", 1)[1]
    assert cli.main(["bench", "evict", "--config", str(saved), "--name", "again"]) == 0
    one, two = (records.read(runs.root() / "bench" / n / "record.json") for n in ("first", "again"))
    same = lambda rec: {k: v for k, v in rec.settings.items() if k not in config.OUTPUT_FIELDS}  # noqa: E731
    assert same(one) == same(two) and one.seed == two.seed and one.settings["name"] == "first"

    def quality(rec):
        return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rec.rows]

    assert quality(one) == quality(two) and len(one.rows) > 5
    # a flag given beside --config wins over the file
    assert cli.main(["bench", "evict", "--config", str(saved), "--limit", "1", "--name", "one-ctx"]) == 0
    assert records.read(runs.root() / "bench" / "one-ctx" / "record.json").settings["eval"]["limit"] == 1


def test_writing_into_the_shipped_assets_needs_the_maintainer_flag(flow, capsys, monkeypatch):
    _, tiny, text = flow
    target = settings.ASSETS_DIR / "policy" / "bench" / "never.json"
    assert cli.main(["bench", "evict", "--models", tiny, "--texts", text, "--limit", "1", "--context-len", "64",
                     "--cont-len", "8", "--question-len", "4", "--keeps", "0.25", "--token-budgets",
                     "--no-natives", "--policies", "--out", str(target)]) == 2
    assert "only --maintainer writes" in capsys.readouterr().err and not target.exists()
    for cmd in (["bench", "evict", "--models", tiny, "--texts", text, "--policies", "--out", str(target)],
                ["bench", "scd", "--figures", str(settings.ASSETS_DIR / "figs")]):  # refused before any model loads
        monkeypatch.setattr("scdviz.models.pair.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
        monkeypatch.setattr("scdviz.models.pair.load_pair", lambda *a, **k: pytest.fail("a pair was loaded"))
        assert cli.main(cmd) == 2
        assert "only --maintainer writes" in capsys.readouterr().err and not target.exists()
    bad = Path(text).with_suffix(".toml")
    bad.write_text("[eval]\nlimit = 3\nnot_a_setting = 1\n")
    assert cli.main(["bench", "evict", "--config", str(bad)]) == 2
    assert "unknown settings eval.not_a_setting" in capsys.readouterr().err


def test_rate_on_a_shipped_calibration_saves_a_new_run_and_leaves_the_shipped_one(flow, monkeypatch, tmp_path):
    """rate updates a calibration in place, except a shipped one (read-only): there the measured
    calibration is saved as a new run; --maintainer updates the shipped file."""
    root, tiny, text = flow
    fake_assets = tmp_path / "assets"
    monkeypatch.setattr(settings, "ASSETS_DIR", fake_assets)
    shipped = fake_assets / "scd" / "tiny"
    assert cli.main(["calibrate", "--producer", tiny, "--consumer", tiny, "--texts", text, "--n-fit", "4",
                     "--n-select", "2", "--prompt-len", "48", "--cont-len", "8",
                     "--n-candidates", "2", "--patch-k", "1", "--op-patch-k", "1", "--rate-windows", "0",
                     "--out", str(shipped)]) == 2  # inside assets/ without the flag: refused
    assert cli.main(["calibrate", "--producer", tiny, "--consumer", tiny, "--texts", text, "--n-fit", "4",
                     "--n-select", "2", "--prompt-len", "48", "--cont-len", "8",
                     "--n-candidates", "2", "--patch-k", "1", "--op-patch-k", "1", "--rate-windows", "0",
                     "--out", str(shipped), "--maintainer"]) == 0
    before = (shipped / "calibration.safetensors").read_bytes()
    assert cli.main(["rate", "--producer", tiny, "--consumer", tiny, "--calib", str(shipped), "--windows", "1"]) == 0
    assert (shipped / "calibration.safetensors").read_bytes() == before
    (made,) = [p for p in (runs.root() / "calibrations").iterdir() if p.name.startswith("tiny-rate-")]
    from scdviz.models.pair import load_pair
    from scdviz.scd import calibration

    assert calibration.Calibration.load(made, load_pair(tiny, tiny)).rate is not None
    assert cli.main(["rate", "--producer", tiny, "--consumer", tiny, "--calib", str(shipped), "--windows", "1",
                     "--maintainer"]) == 0
    assert (shipped / "calibration.safetensors").read_bytes() != before
