"""The test-slice ledger (docs/test_ledger.json, written by ``python -m research.test_ledger`` from the git
history): every shipped test-slice record is in it under its path and ``created`` time, what it calls
shipped is, its entries run in date order, and docs/results.md's table has one row per entry."""

from __future__ import annotations

import json

import pytest

from scdviz import records, report, settings


@pytest.fixture(scope="module")
def ledger() -> list[dict]:
    return json.loads((settings.REPO_DIR / report.LEDGER).read_text(encoding="utf-8"))


def _shipped_test_records() -> dict[str, str]:
    """Path (relative to the checkout) -> ``created`` of every bench record under assets/ that read the test slice."""
    out = {}
    for path in sorted(settings.ASSETS_DIR.rglob("*")):
        if not (path.is_file() and records.is_record_name(path.name)):
            continue
        try:
            record = records.read(path)
        except ValueError:  # a JSON file that is not a bench record (a log, an adapter's config)
            continue
        if report.slice_of(record) == "test":
            out[path.relative_to(settings.REPO_DIR).as_posix()] = record.created
    return out


def _missing(entries: list[dict], shipped: dict[str, str]) -> list[str]:
    """The shipped test records no entry names as shipped with the same ``created`` time."""
    listed = {(e["shipped"], e["date"]) for e in entries}
    return [f"{path} ({created})" for path, created in shipped.items() if (path, created) not in listed]


def test_every_shipped_test_slice_record_is_in_the_ledger(ledger):
    shipped = _shipped_test_records()
    assert shipped, "no shipped record reads the test slice: the check would pass on nothing"
    missing = _missing(ledger, shipped)
    assert not missing, f"not in {report.LEDGER} (run python -m research.test_ledger): {missing}"


def test_the_coverage_check_fails_on_a_ledger_without_one_run(ledger):
    shipped = _shipped_test_records()
    dropped = next(e for e in ledger if e["shipped"])
    assert _missing([e for e in ledger if e is not dropped], shipped) == [f"{dropped['shipped']} ({dropped['date']})"]


def test_what_the_ledger_calls_shipped_is_shipped_and_the_rest_is_gone(ledger):
    shipped = _shipped_test_records()
    for e in ledger:
        if e["shipped"]:
            assert shipped.get(e["shipped"]) == e["date"], f"{e['shipped']} is not that run's record now"
        else:
            assert not (settings.REPO_DIR / e["record"]).exists() or shipped.get(e["record"]) != e["date"], e


def test_entries_are_in_date_order_and_complete(ledger):
    dates = [e["date"] for e in ledger]
    assert dates == sorted(dates)
    for e in ledger:
        assert e["family"] in ("SCD", "eviction") and e["record"].startswith("assets/") and e["result"], e
        assert e["commit"] is None or len(e["commit"]) >= 7, e
    # the change after a test run that docs/results.md discloses stays in the ledger though its record left the tree
    assert any(e["commit"] == "27adf5f" and "distillcache-student-decode: " in e["result"] for e in ledger)


def test_the_table_has_one_row_per_entry(ledger):
    table = report.render("test-ledger")
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| # |")]
    assert len(rows) == len(ledger)
    for i, (row, e) in enumerate(zip(rows, ledger, strict=True), 1):
        cells = row.split(" | ")
        assert cells[0] == f"| {i}" and f"`{e['record']}`" in cells and e["result"] in cells, row
        assert cells[-1].startswith("yes") == bool(e["shipped"]), row
