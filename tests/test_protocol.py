"""Fast tier: the benchmark protocol both methods share (scdviz.protocol), on hand-made values."""

from __future__ import annotations

import pandas as pd
import pytest

from scdviz import metrics, protocol, records


def test_lodo_holds_each_domain_out_once_and_the_fit_never_sees_it():
    fits, evals = [], []

    def fit(others):
        fits.append(list(others))
        return f"fitted on {'+'.join(others)}"

    def evaluate(domain, artefact):
        evals.append((domain, artefact))
        return {"domain": domain, "artefact": artefact}

    out = protocol.by_domain(["a", "b", "c"], evaluate, "shipped", fit=fit, seen=["a", "b", "c"], what="policy")
    assert fits == [["b", "c"], ["a", "c"], ["a", "b"]]  # in the order seen, the held-out one missing
    assert [d for d, _ in evals] == ["a", "b", "c"]  # each held out exactly once
    assert all(domain not in fitted.split("on ")[1].split("+") for domain, fitted in evals)
    assert out[1] == {"domain": "b", "artefact": "fitted on a+c"}
    # one domain only: still fitted on all the others
    fits.clear()
    assert protocol.by_domain(["c"], evaluate, fit=fit, seen=["a", "b", "c"])[0]["artefact"] == "fitted on a+b"
    # without fit: the caller's artefact measures every domain, nothing is fitted
    fits.clear()
    assert [r["artefact"] for r in protocol.by_domain(["a", "x"], evaluate, "shipped")] == ["shipped", "shipped"]
    assert fits == []


def test_lodo_refuses_one_domain_and_a_domain_never_seen():
    with pytest.raises(ValueError, match="needs a calibration of 2\\+ domains; this one saw \\['a'\\]"):
        protocol.by_domain(["a"], lambda d, a: a, fit=lambda o: o, seen=["a"], what="calibration")
    with pytest.raises(ValueError, match="only a domain the policy saw \\(a, b\\); not x"):
        protocol.by_domain(["a", "x"], lambda d, a: a, fit=lambda o: o, seen=["a", "b"], what="policy")


def test_vs_best_picks_the_baseline_with_the_lowest_mean_and_pairs_the_items():
    values = {"learned": [0.10, 0.10, 0.30], "A": [0.20, 0.12, 0.10], "B": [0.05, 0.30, 0.11], "other": [0.0] * 3}
    out = protocol.vs_best(values, "learned", ["A", "B"])  # "other" is not a baseline: never the best
    assert out["best"] == "A"  # A: mean 0.14 < B: 0.1533
    assert out["mean"] == pytest.approx(0.5 / 3) and out["best_mean"] == pytest.approx(0.14) and out["n"] == 3
    assert out["wins"] == pytest.approx(2 / 3)  # 0.10 < 0.20, 0.10 < 0.12; not 0.30 < 0.10
    assert out["above"] == 1
    boot = metrics.paired_bootstrap([0.20, 0.12, 0.10], [0.10, 0.10, 0.30])
    assert out["boot"] == boot and out["boot"]["diff"] == pytest.approx(0.5 / 3 - 0.14)
    assert protocol.vs_best(values, "learned", ["B", "A"])["best"] == "A"  # order does not matter unless tied
    tied = {"m": [1.0], "x": [2.0], "y": [2.0]}
    assert protocol.vs_best(tied, "m", ["y", "x"])["best"] == "y"  # the first of equals
    assert protocol.vs_best(tied, "m", ["x"])["boot"] is None  # one item: no interval
    assert protocol.vs_best(tied, "m", ["x"], min_n=1)["boot"]["ratio"] == pytest.approx(0.5)


def test_per_domain_chooses_the_best_baseline_again_on_each_domains_items():
    domains = ["x", "x", "y", "y"]
    values = {"learned": [0.1, 0.2, 0.5, 0.6], "A": [0.3, 0.3, 0.4, 0.4], "B": [0.4, 0.4, 0.2, 0.3]}
    out = dict(protocol.per_domain(domains, values, "learned", ["A", "B"]))
    assert list(out) == ["x", "y"]
    assert out["x"]["best"] == "A" and out["y"]["best"] == "B"  # over all items B is (1.3 < 1.4)
    assert out["x"]["mean"] == pytest.approx(0.15) and out["x"]["wins"] == 1.0 and out["x"]["above"] == 0
    assert out["y"]["best_mean"] == pytest.approx(0.25) and out["y"]["wins"] == 0.0 and out["y"]["above"] == 2
    assert out["y"]["boot"]["diff"] == pytest.approx(0.55 - 0.25)
    assert out["y"]["boot"] == metrics.paired_bootstrap([0.2, 0.3], [0.5, 0.6])


def test_interval_cells_and_a_paired_interval_on_hand_made_data():
    assert protocol.interval([0.5, 1.25]) == "[0.500, 1.250]"
    assert protocol.interval([-0.01, 0.02], "+.4f") == "[-0.0100, +0.0200]"
    assert protocol.interval(None) == ""
    # every item 0.1 better: the difference and its whole interval are -0.1, the ratio 0.75
    boot = protocol.vs_best({"m": [0.3, 0.1, 0.2], "b": [0.4, 0.2, 0.3]}, "m", ["b"])["boot"]
    assert boot["diff"] == pytest.approx(-0.1) and boot["diff_ci"] == pytest.approx([-0.1, -0.1])
    assert boot["ratio"] == pytest.approx(0.6 / 0.9)


def test_rows_become_one_record_and_records_merge_in_order():
    a = protocol.record("scd", [{"kl": 0.1}], {"bench": {"limit": 2}}, 7, "cpu", 1.25)
    b = protocol.record("scd", [{"kl": 0.2}, {"kl": float("nan")}], {"bench": {"limit": 2}}, 7, "cpu", 2.0)
    assert isinstance(a, records.BenchRecord) and a.kind == "scd" and a.seed == 7 and a.seconds == 1.2
    assert a.versions["device"] == "cpu" and a.created
    both = protocol.merge([a, b], settings={"consumers": ["x", "y"]})
    assert [r["kl"] for r in both.rows[:2]] == [0.1, 0.2] and len(both.rows) == 3
    assert both.settings == {"consumers": ["x", "y"]} and both.seconds == pytest.approx(3.2)
    assert protocol.merge([a], seconds=9.0).seconds == 9.0 and protocol.merge([a]).settings == a.settings
    with pytest.raises(ValueError, match="several kinds"):
        protocol.merge([a, protocol.record("evict", [], {}, 0)])
    with pytest.raises(ValueError, match="no record"):
        protocol.merge([])


def test_show_prints_every_column_without_the_index():
    text = protocol.show(pd.DataFrame([{"method": "raw KV", "kl": 0.25, "ci": None}, {"method": "SCD", "kl": 0.125}]))
    lines = text.splitlines()
    assert lines[0].split() == ["method", "kl", "ci"] and len(lines) == 3
    assert lines[1].split()[:3] == ["raw", "KV", "0.250"] and "NaN" not in text
    assert protocol.show(pd.DataFrame()) == "(no rows)"
