"""One house for both methods: configs make the CLI, one artefact format, one bench record type."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from scdviz import artefact, cli, commands, config, records
from scdviz.evict.bench import EvalConfig
from scdviz.evict.policy import Policy, PolicyConfig
from scdviz.evict.student import Student, is_student
from scdviz.evict.train import TrainConfig
from scdviz.models.pair import PairError

REQUIRED = {"model-card": ["--name", "jargon"]}


def _argv(name: str) -> list[str]:
    return name.split() + REQUIRED.get(name, [])


@pytest.mark.parametrize("name", [c[0] for c in cli.COMMANDS if c[2] is not None])
def test_cli_defaults_are_the_config_defaults(name):
    """Parsing only the required flags gives exactly the dataclass defaults (one place for defaults)."""
    settings = next(c[2] for c in cli.COMMANDS if c[0] == name)
    args = cli.parser().parse_args(_argv(name))
    got = config.from_args(settings, args)
    required = {a.lstrip("-").replace("-", "_"): v
                for a, v in zip(REQUIRED.get(name, [])[::2], REQUIRED.get(name, [])[1::2])}
    assert got == settings(**required)


def test_every_flag_has_help_with_its_default():
    for name, _, settings, _ in cli.COMMANDS:
        if settings is None:
            continue
        sub = cli.parser()._subparsers._group_actions[0].choices[name.split()[0]]
        if " " in name:
            sub = sub._subparsers._group_actions[0].choices[name.split()[1]]
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings} has no help"
            if action.default not in (None, [], False) and not action.required:
                assert "(default:" in action.help, f"{name} {action.option_strings} hides its default"


def test_lists_are_space_separated_and_become_the_field_type():
    args = cli.parser().parse_args(["bench", "evict", "--keeps", "0.5", "0.125", "--token-budgets", "96", "--modes",
                                    "agnostic", "aware", "--no-qa"])
    cmd = config.from_args(commands.BenchEvict, args)
    assert cmd.eval.keeps == (0.5, 0.125) and cmd.eval.token_budgets == (96,)
    assert cmd.eval.modes == ("agnostic", "aware") and cmd.eval.qa is False
    args = cli.parser().parse_args(["train-policy", "--out", "r", "--no-per-head", "--window", "64"])
    assert config.from_args(commands.TrainPolicy, args).train.policy == PolicyConfig(per_head=False, window=64)


def test_config_without_help_is_refused():
    import argparse
    from dataclasses import dataclass

    @dataclass
    class Bare:
        x: int = 1

    with pytest.raises(TypeError, match="Bare.x has no help"):
        config.add_arguments(argparse.ArgumentParser(), Bare)


def test_saved_config_is_read_tolerantly():
    saved = config.to_dict(EvalConfig(limit=3, keeps=(0.5,)))
    saved.pop("cont_len")
    saved["renamed_knob"] = 7
    cfg, unknown = config.from_dict(EvalConfig, saved)
    assert cfg == EvalConfig(limit=3, keeps=(0.5,)) and unknown == ["renamed_knob"]
    nested, unknown = config.from_dict(TrainConfig, {"out": "o", "policy": {"window": 9, "gone": 1}})
    assert nested.policy.window == 9 and unknown == ["policy.gone"]
    with pytest.raises(ValueError, match="expected a mapping"):
        config.from_dict(EvalConfig, [1, 2])


# ----------------------------------------------------------------------------- artefacts


def test_artefact_round_trip_and_refusals(tmp_path):
    policy = Policy(PolicyConfig(hidden=4, window=7))
    policy.identity = {"model_source": "tiny", "model_fingerprint": "abc"}
    path = policy.save(tmp_path / "p.safetensors", meta={"steps": 3})
    back = Policy.load(path)
    assert back.config == policy.config and back.identity == policy.identity and back.meta == {"steps": 3}
    for a, b in zip(back.state_dict().values(), policy.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="holds a distillcache policy, not a scd calibration"):
        artefact.load(path, "scd-calibration")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="has no scdviz header"):
        Policy.load(tmp_path / "plain.safetensors")
    header = {"kind": "distillcache-policy", "version": 1, "identity": {}, "config": {}, "meta": {}}
    save_file({"w": torch.zeros(2)}, str(tmp_path / "old.safetensors"), metadata={"scdviz": json.dumps(header)})
    with pytest.raises(ValueError, match="of format 1; this scdviz reads format 2"):
        Policy.load(tmp_path / "old.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x01" * 40)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        Policy.load(tmp_path / "junk.safetensors")
    wrong = Policy(PolicyConfig(hidden=5, window=7))
    artefact.save(tmp_path / "w.safetensors", "distillcache-policy", wrong.state_dict(), {},
                  config.to_dict(policy.config))
    with pytest.raises(ValueError, match="weights do not fit its config"):
        Policy.load(tmp_path / "w.safetensors")


def test_identity_check_names_what_differs():
    saved = {"a_source": "p", "fp": "1", "tok": "t"}
    artefact.check_identity(saved, dict(saved), {"fp": "weights"}, "x", str, "fix")
    with pytest.raises(PairError, match="(?s)x was made for .*weights: saved '1', loaded '2'.*fix"):
        artefact.check_identity(saved, saved | {"fp": "2"}, {"fp": "weights", "tok": "tokenizer"}, "x", str, "fix")


# ----------------------------------------------------------------------------- bench records


def _strict(text: str):
    def bad(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=bad)


def test_record_is_strict_json_with_settings_versions_and_seed(tmp_path):
    cmd = commands.BenchEvict(eval=EvalConfig(limit=4, keeps=(0.25,)), out=str(tmp_path / "r.json"))
    rows = [{"method": "m", "kl": float("nan"), "se": math.inf, "steps": (1.0, float("-inf"))}]
    rec = records.make("evict", config.to_dict(cmd), 5, rows, "cpu")
    path = records.write(rec, tmp_path / "r.json")
    obj = _strict(path.read_text())
    assert obj["rows"][0] == {"method": "m", "kl": None, "se": None, "steps": [1.0, None]}
    assert obj["kind"] == "evict" and obj["seed"] == 5 and obj["versions"]["device"] == "cpu"
    assert obj["versions"]["torch"] == torch.__version__ and obj["created"]
    lines = path.read_text().splitlines()
    assert len(lines) == len(obj) + len(rows) + 3  # braces, a line per field and per row, the rows' closing bracket
    back = records.read(path)
    again, unknown = config.from_dict(commands.BenchEvict, back.settings)
    assert again == cmd and unknown == []  # the record says how to run it again
    with pytest.raises(ValueError, match="unknown bench kind"):
        records.BenchRecord("speed", {}, 0, rows)


def test_a_gzipped_record_reads_as_its_json_and_a_bomb_is_refused(tmp_path, monkeypatch):
    """``*.json.gz``: the same record as the JSON (read back equal, the same bytes on every write: no time
    stamp), its config named by the stem; a file that is not gzip, or unpacks past the cap, is refused."""
    import gzip

    rec = records.BenchRecord("scd", {"bench": {"limit": 3}}, 0, [{"row": "measured", "kl": 0.5}])
    plain, packed = records.write(rec, tmp_path / "r.json"), records.write(rec, tmp_path / "r.json.gz")
    assert records.read(packed) == records.read(plain) and gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    first = packed.read_bytes()
    assert records.write(rec, tmp_path / "r.json.gz").read_bytes() == first
    assert records.stem(packed) == records.stem(plain) == "r" and records.is_record_name("R.JSON.GZ")
    (tmp_path / "not.json.gz").write_text("{}")
    with pytest.raises(ValueError, match="not a gzipped file"):
        records.read(tmp_path / "not.json.gz")
    monkeypatch.setattr(records, "MAX_UNPACKED", 100)
    with pytest.raises(ValueError, match="unpacks to more than"):
        records.read(packed)


def test_shipped_records_and_artefacts_are_current():
    """Every shipped bench file is a record of its kind; every shipped artefact loads in this format (a record's
    settings and a calibration's config may hold settings retired since, ``commands.RETIRED_SETTINGS`` and
    ``calibration.RETIRED_CONFIG``, and nothing else the CLI does not know)."""
    from scdviz import settings
    from scdviz.scd import calibration

    shipped = [p for pattern in ("scd/*/*", "policy/bench/*") for p in settings.ASSETS_DIR.glob(pattern)
               if records.is_record_name(p.name)]
    assert any(p.name.endswith(".json.gz") for p in shipped)  # gzipped records are checked as the others
    for path in shipped:
        rec = records.read(path)
        scd = path.relative_to(settings.ASSETS_DIR).parts[0] == "scd"
        name = records.stem(path)
        kind = "ttft" if name.startswith("ttft") else "cost" if name.endswith("cost") else "scd" if scd else "evict"
        assert rec.kind == kind, path
        assert set(config.from_dict(commands.BENCHES[rec.kind], rec.settings)[1]) <= commands.RETIRED_SETTINGS, path
    for path in settings.ASSETS_DIR.glob("policy/*/*.safetensors"):
        loaded = Student.load(path) if is_student(path) else Policy.load(path)
        assert loaded.identity["model_source"] == "builtin:smollm2-135m"
    for folder in settings.ASSETS_DIR.glob("scd/*/"):
        art = artefact.load(folder / calibration.FILE, calibration.KIND)
        assert art.identity["consumer_source"] == f"builtin:{folder.name}"
        assert set(config.from_dict(calibration.CalibConfig, art.config)[1]) <= calibration.RETIRED_CONFIG, folder


# an artefact's own files (a policy's training log, an adapter's config, card and log): not bench records
COMPANIONS = frozenset({"log.json", "adapter_config.json", "eval.json", "train_log.json"})


def test_every_shipped_record_is_read_by_a_table_or_named_by_a_test(monkeypatch):
    """A shipped record nothing reads is a leftover: every bench record under assets/ (``records.is_record_name``,
    an artefact's own files aside) is read by a generated docs table (each of ``report.TABLES`` rendered with
    ``report.shipped_record`` watched) or named by a test file (its path under assets/, or its file name and its
    folder's as string literals)."""
    from scdviz import report, settings

    shipped = sorted(p.relative_to(settings.ASSETS_DIR).as_posix() for p in settings.ASSETS_DIR.rglob("*")
                     if p.is_file() and records.is_record_name(p.name) and p.name not in COMPANIONS)
    assert shipped
    for rel in shipped:
        records.read(settings.ASSETS_DIR / rel)  # each is a record (a new kind of companion file must be named)
    read, inner = set(), report.shipped_record

    def watched(rel: str):
        read.add(str(rel))
        return inner(rel)

    monkeypatch.setattr(report, "shipped_record", watched)
    for name in report.TABLES:
        report.render(name)
    tests = [p.read_text() for p in Path(__file__).parent.glob("*.py")]

    def named(rel: str) -> bool:
        folder, name = rel.split("/")[-2:]
        return any(rel in text or (f'"{name}"' in text and f'"{folder}"' in text) for text in tests)

    unread = [rel for rel in shipped if rel not in read and not named(rel)]
    assert unread == [], f"records no table reads and no test names (retire them, docs/history.md): {unread}"


def test_each_shipped_policy_folder_is_in_the_lineup_made_for_the_producer_with_its_training_log():
    """Each folder of assets/policy/ (but bench/) is one shipped method, at most four (one recipe per method):
    its best.safetensors is in the bench's lineup (``SHIPPED_POLICIES``, what `bench evict` and the app load), was
    made for the built-in producer, and has its training log beside it: the settings that made it (with how it
    validated: the tail after ``question_len`` tokens, spread windows or not, which the chooser and --lodo read),
    its validation KLs, the one its file records among them, and the heuristic's KL on the same contexts."""
    from scdviz import settings
    from scdviz.evict import bench, student_fit

    folders = {p for p in (settings.ASSETS_DIR / "policy").iterdir() if p.is_dir() and p.name != "bench"}
    assert 1 <= len(folders) <= 4, sorted(p.name for p in folders)
    assert {p.parent for p in bench.SHIPPED_POLICIES} == folders
    assert all(p.name == "best.safetensors" and p.is_file() for p in bench.SHIPPED_POLICIES)
    loaded = bench.load_all(())
    assert len(loaded) == len(folders)
    for name, one in loaded.items():
        art, log = one.policy, one.log
        assert art.identity["model_source"] == "builtin:smollm2-135m", name
        assert log and log["val"] and log["val_heuristic"] > 0, name
        assert {"corpora", "question_len", "spread"} <= set(log["config"]), name
        recipe = student_fit.FitConfig if isinstance(art, Student) else TrainConfig
        assert config.from_dict(recipe, log["config"])[0].corpora, name
        assert one.validation_kl == round(art.meta["val_kl"], 5) in {v["kl"] for v in log["val"]}, name


def test_shipped_configs_run_as_their_first_line_says():
    """Every shipped TOML config names its command on its first line, and that command reads it: a rerun
    must not stop at a setting the CLI has since retired."""
    from scdviz import settings

    classes = {name: cls for name, _, cls, _ in cli.COMMANDS}
    paths = sorted(settings.ASSETS_DIR.rglob("*.toml"))
    assert paths
    for path in paths:
        first = path.read_text().splitlines()[0]
        m = re.match(r"# python -m scdviz (bench \w+|[\w-]+) --config (\S+)", first)
        assert m, (path, first)
        assert m.group(2) == str(path.relative_to(settings.ASSETS_DIR.parent)), path
        config.read_toml(classes[m.group(1)], str(path))  # raises on an unknown (or retired) setting


def test_configs_have_help_on_every_field():
    from scdviz.finetune import FinetuneConfig
    from scdviz.scd.bench import ScdBenchConfig
    from scdviz.scd.calibration import CalibConfig

    for cls in (EvalConfig, TrainConfig, PolicyConfig, FinetuneConfig, ScdBenchConfig, CalibConfig):
        for f in fields(cls):
            assert f.metadata.get("help") or f.name == "policy", f"{cls.__name__}.{f.name}"


def test_the_tree_fits_the_device_machine():
    """Tracked files travel to the GPU machine, 64 MiB at most with the carried wheels (about 1 MiB): shipped
    artefacts must leave room (52 MiB here: the tree was cut to 46 MiB, so the headroom for the next artefact is
    real; a new one that does not fit means retiring an old one, docs/history.md)."""
    import subprocess

    from scdviz import settings

    names = subprocess.run(["git", "ls-files", "-z"], cwd=settings.REPO_DIR, capture_output=True, check=True).stdout
    if not names:
        pytest.skip("not a git checkout")
    files = [settings.REPO_DIR / n for n in names.decode().split("\0") if n]
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total < 52 * 2**20, f"tracked files take {total / 2**20:.1f} MiB"


def test_a_shipped_ttft_record_opens_in_the_results_tab_view():
    from scdviz import plots, settings
    from scdviz.app import results

    (path,) = settings.ASSETS_DIR.glob("scd/jargon/ttft_receive.json")
    df, kind = results.load_results(path)
    assert kind == "ttft" and df["method"].iloc[0] == "oracle"
    from scdviz import records

    fig = plots.record_figures([("ttft", records.read(path))])["ttft"]
    drawn = {t.name for t in fig.data}
    assert set(df["method"].iloc[1:]) <= drawn  # every method a line of TTFT against link speed


@pytest.mark.parametrize("name", [c[0] for c in cli.COMMANDS if c[2] is not None])
def test_a_saved_config_parses_back_to_the_same_settings(name, tmp_path):
    """config.toml, as every run saves it, read with --config gives the run's settings again
    (all but where it wrote), for every command; a changed value in the file is honoured."""
    settings = next(c[2] for c in cli.COMMANDS if c[0] == name)
    argv = _argv(name)
    first = config.from_args(settings, cli.parser().parse_args(argv))
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(config.to_dict(first)))
    top = cli.parser()
    args = top.parse_args(argv)
    args.parser.set_defaults(**config.read_toml(settings, str(path)))
    again = config.from_args(settings, top.parse_args(argv))

    def kept(cmd):
        return {k: v for k, v in config.to_dict(cmd).items() if k not in config.OUTPUT_FIELDS}

    assert kept(again) == kept(first)


def test_a_config_file_value_is_used_and_a_flag_beside_it_wins(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('producer = "builtin:x"\n\n[bench]\nlimit = 5\nbudgets = [2500.0, 3800.0]\n')
    top = cli.parser()
    args = top.parse_args(["bench", "scd", "--limit", "7"])
    args.parser.set_defaults(**config.read_toml(commands.BenchScd, str(path)))
    cmd = config.from_args(commands.BenchScd, top.parse_args(["bench", "scd", "--limit", "7"]))
    assert cmd.producer == "builtin:x" and cmd.bench.budgets == (2500.0, 3800.0) and cmd.bench.limit == 7

