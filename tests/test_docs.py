"""The docs' results tables are the shipped records': every marked block of README.md and docs/
is what ``scdviz.report`` renders from them, one cell checked by hand against a record's rows,
and ``python -m scdviz report --check`` fails on a doctored copy."""

from __future__ import annotations

import copy
import shutil

import pytest

from scdviz import cli, records, report, settings


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """Every table the docs mark, rendered once for the module."""
    return {name: report.render(name) for name in report.TABLES}


def _marked() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in report.doc_files():
        for name, _ in report.blocks(path.read_text()):
            out.setdefault(name, []).append(path.relative_to(settings.REPO_DIR).as_posix())
    return out


def test_every_marked_block_equals_what_the_records_give(rendered):
    files = report.doc_files()
    assert settings.REPO_DIR / "README.md" in files and any("docs" in p.parts for p in files)
    assert report.stale(files, dict(rendered)) == []


def test_every_table_is_in_the_docs_and_the_readme_has_its_headline():
    marked = _marked()
    assert set(marked) == set(report.TABLES), f"tables no doc shows: {set(report.TABLES) - set(marked)}"
    assert "README.md" in marked["headline"]


def test_each_table_names_its_records_and_the_command_that_made_them(rendered):
    for name, text in rendered.items():
        last = text.rstrip().splitlines()[-1]
        assert last.startswith("*Records"), name
        assert "assets/" in last and ("python -m scdviz bench" in last or "python -m research." in last), name


def test_one_cell_by_hand_scd_over_raw_on_jargon():
    """The headline's jargon SCD cell: mean KL of SCD full over raw KV's, from the test record's rows."""
    rows = records.read(settings.ASSETS_DIR / "scd" / "jargon" / "test.json").rows
    by = {r["method"]: r for r in rows if r.get("group") == "method"}
    scd, raw = by["SCD full"]["kl_per_prompt"], by["raw KV"]["kl_per_prompt"]
    ratio = (sum(scd) / len(scd)) / (sum(raw) / len(raw))
    assert f"{ratio:.2f}" == "0.29"  # the README's cell since the 1,800-window stage (0.31 with the 180-window one)
    closed = by["SCD full (closed form)"]["kl_per_prompt"]  # its twin: the closed form's own test run said 0.34
    assert f"{(sum(closed) / len(closed)) / (sum(raw) / len(raw)):.2f}" == "0.34"
    cell = next(line for line in report.render("headline").splitlines()
                if line.startswith("| SCD (trained), int4") and "| jargon," in line).split(" | ")[3]
    assert cell.startswith(f"{ratio:.2f}× [")
    own = next(line for line in report.render("scd-own").splitlines() if line.startswith("| jargon | **SCD** |"))
    assert f"| {by['SCD full']['kl']:.4f} ± {by['SCD full']['kl_se']:.4f} |" in own
    assert f"| {by['SCD full']['ppl']:.2f} |" in own  # the continuation perplexity the record carries


def test_one_cell_by_hand_eviction_kl_of_the_chosen_policy():
    rows = records.read(settings.ASSETS_DIR / "policy" / "bench" / "test.json").rows
    chosen = next(r for r in rows if r.get("chosen_on_validation") and r["keep"] == "0.25")
    mean = sum(chosen["kl_per_context"]) / len(chosen["kl_per_context"])
    line = next(x for x in report.render("evict-headline").splitlines() if x.startswith("| 25 % | " + chosen["method"]))
    assert f"| {mean:.4f} ± " in line


def _copy_docs(tmp_path):
    shutil.copy(settings.REPO_DIR / "README.md", tmp_path / "README.md")
    shutil.copytree(settings.REPO_DIR / "docs", tmp_path / "docs")
    return tmp_path


def test_check_passes_on_the_docs_and_fails_on_a_doctored_block(tmp_path, capsys):
    root = _copy_docs(tmp_path)
    assert cli.main(["report", "--check", "--root", str(root)]) == 0
    target = root / "docs" / "results.md"
    text = target.read_text()
    name, body = next(b for b in report.blocks(text) if b[0] == "scd-lodo")
    doctored = body.replace("0.61×", "0.51×", 1)
    assert doctored != body
    target.write_text(text.replace(body, doctored, 1))
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(["report", "--check", "--root", str(root)])
    assert done.value.code == 1
    out = capsys.readouterr().out
    assert f"{target}: table scd-lodo" in out and out.count(": table ") == 1
    cli.main(["report", "--root", str(root)])  # rewriting puts the records' numbers back
    assert target.read_text() == text


def test_an_unknown_table_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        report.render("nope")


def test_a_specialist_without_a_tables_record_is_left_out_of_that_table_only(rendered, monkeypatch):
    """A specialist shipped after a run was made (no ``scd/<name>/<record>`` yet) is not in that run's tables; the
    others' rows and sources are as before, and a specialist left out of SPECIALISTS leaves every table it was in."""
    first, others = report.SPECIALISTS[0], report.SPECIALISTS[1:]
    monkeypatch.setattr(report, "SPECIALISTS", (*report.SPECIALISTS, "not-shipped"))
    for name in ("scd-own", "scd-budget", "scd-patch", "scd-lodo", "scd-qa", "scd-tail", "scd-ttft", "headline"):
        assert report.render(name) == rendered[name], name
    monkeypatch.setattr(report, "SPECIALISTS", (first,))
    own = report.render("scd-own")
    assert own != rendered["scd-own"] and all(line.startswith(f"| {first} |") for line in own.splitlines()[2:]
                                              if line.startswith("| ") and not line.startswith("| specialist"))
    assert others and f"scd/{first}/" in own and all(f"scd/{s}/" not in own for s in others)


def test_the_task_table_by_hand_and_its_records_must_share_items(monkeypatch):
    """scd-task: raw reuse's share of the oracle's task F1 is the mean of its per-item F1 over the oracle's, from the
    test record's rows; the producer's F1 comes from the frontier record on the same items, and a frontier record
    whose oracle answered other items is refused, not joined."""
    rel = f"scd/{report.TASK_SPECIALIST}/test.json"
    rows = records.read(settings.ASSETS_DIR / rel).rows
    by = {r["method"]: r for r in rows if r.get("group") == "method"}
    share = sum(by["raw KV"]["qa_f1_items"]) / sum(by["oracle"]["qa_f1_items"])
    table = report.render("scd-task")
    line = next(x for x in table.splitlines() if x.startswith("| raw reuse's task F1 ÷ the oracle's |"))
    assert line.split(" | ")[1].startswith(f"{share:.2f}× [")
    assert ("| yes |" in line) == (share <= report.RAW_LINE["share"])
    shipped = report.shipped_record

    def doctored(name):
        if name != report.TASK_FRONTIER:
            return shipped(name)
        got = copy.deepcopy(shipped(name))  # the shipped one is cached for every other table: never changed
        for r in got.rows:
            r["qa_f1_oracle"] = [1.0 - x for x in r["qa_f1_oracle"]]
        return got

    monkeypatch.setattr(report, "shipped_record", doctored)
    with pytest.raises(ValueError, match="answered on different items"):
        report.render("scd-task")
