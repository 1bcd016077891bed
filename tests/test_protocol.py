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


# ----------------------------------------------------------------------------- the evaluation protocol


def test_kl_is_kl_of_the_reference_to_the_method_by_hand():
    import math

    import torch

    p, q = [0.7, 0.2, 0.1], [0.2, 0.5, 0.3]
    ref = torch.tensor([[math.log(x) + 3.0 for x in p]])  # softmax ignores the shift
    method = torch.tensor([[math.log(x) - 1.0 for x in q]])
    # KL(p || q) = 0.7 ln 3.5 + 0.2 ln 0.4 + 0.1 ln(1/3) = 0.58381; KL(q || p) = 0.53718
    assert float(metrics.kl_per_token(ref, method)[0]) == pytest.approx(0.583808, abs=1e-5)
    assert float(metrics.kl_per_token(method, ref)[0]) == pytest.approx(0.537180, abs=1e-5)
    assert float(metrics.kl_per_token(ref, ref)[0]) == pytest.approx(0.0, abs=1e-7)


def test_cluster_bootstrap_resamples_whole_passages():
    a = [0.10, 0.32, 0.21, 0.45, 0.17, 0.28, 0.39, 0.12]
    b = [0.11, 0.20, 0.25, 0.30, 0.10, 0.26, 0.33, 0.09]
    # one cluster per item is the item bootstrap, draw for draw
    alone = metrics.paired_bootstrap(a, b, clusters=list(range(8)))
    assert alone["diff_ci"] == pytest.approx(metrics.paired_bootstrap(a, b)["diff_ci"], abs=1e-12)
    # every window seen twice (two windows of one passage, equal values): resampling passages gives the
    # item bootstrap of the 8 distinct values; resampling windows would pretend 16 items and be narrower
    twice_a, twice_b = [x for x in a for _ in range(2)], [x for x in b for _ in range(2)]
    passages = [i // 2 for i in range(16)]
    clustered = metrics.paired_bootstrap(twice_a, twice_b, clusters=passages)
    assert clustered["diff_ci"] == pytest.approx(alone["diff_ci"], abs=1e-12) and clustered["clusters"] == 8
    naive = metrics.paired_bootstrap(twice_a, twice_b)
    assert naive["diff_ci"][1] - naive["diff_ci"][0] < 0.85 * (clustered["diff_ci"][1] - clustered["diff_ci"][0])
    # one passage only: every resample is the whole sample, the interval is the mean itself
    one = metrics.bootstrap_mean(a, clusters=["p"] * 8)
    assert one["ci"] == pytest.approx([sum(a) / 8] * 2, abs=1e-12)
    with pytest.raises(ValueError, match="cluster labels"):
        metrics.paired_bootstrap(a, b, clusters=[0, 1])


def test_vs_best_and_per_domain_pass_the_clusters_on():
    values = {"m": [0.1, 0.1, 0.2, 0.2], "base": [0.2, 0.2, 0.1, 0.1]}
    together = protocol.vs_best(values, "m", ["base"], clusters=["x", "x", "y", "y"])
    assert together["boot"]["clusters"] == 2
    assert protocol.vs_best(values, "m", ["base"])["boot"]["clusters"] == 4
    [(_, x)] = protocol.per_domain(["d"] * 4, values, "m", ["base"], clusters=["x", "x", "y", "y"])
    assert x["boot"]["clusters"] == 2


def test_a_test_slice_run_refuses_an_uncommitted_tree(monkeypatch):
    from scdviz.evict import bench as evict_bench
    from scdviz.evict import cost
    from scdviz.scd import bench as scd_bench
    from scdviz.scd import ttft

    protocol.check_slice("dev")  # dev: always
    with pytest.raises(ValueError, match="unknown slice"):
        protocol.check_slice("eval")
    for commit, ok in (("0123abc", True), ("0123abc+dirty", False), (None, False)):
        monkeypatch.setattr(records, "git_commit", lambda c=commit: c)
        monkeypatch.setattr(records, "loaded_commit", lambda c=commit: c)
        if ok:
            protocol.check_slice("test")
            continue
        with pytest.raises(ValueError, match="clean, committed git checkout"):
            protocol.check_slice("test")
        # both benches refuse before loading or measuring anything (pair None would fail later)
        with pytest.raises(ValueError, match="clean, committed git checkout"):
            scd_bench.run(scd_bench.ScdBenchConfig(slice="test"), None)
        with pytest.raises(ValueError, match="clean, committed git checkout"):
            evict_bench.run(evict_bench.EvalConfig(slice="test"), None)
        with pytest.raises(ValueError, match="clean, committed git checkout"):  # and both timing benches
            cost.run(cost.CostConfig(slice="test"), None, None)
        with pytest.raises(ValueError, match="clean, committed git checkout"):
            ttft.run(ttft.TtftConfig(slice="test"), None, None)


def test_a_record_names_the_commit_its_process_loaded_not_the_one_at_its_end(monkeypatch):
    """A long test-slice run outlives edits: its record is stamped with the commit checked when the process loaded
    its code (``records.loaded_commit``, asked once), and a checkout that changed since then is refused."""
    states = iter(["0123abc", "4567def+dirty"])
    monkeypatch.setattr(records, "git_commit", lambda: next(states))
    records.loaded_commit.cache_clear()
    try:
        assert records.loaded_commit() == "0123abc"  # as the run starts
        assert records.versions()["git_commit"] == "0123abc"  # as its record is written, the checkout edited since
        monkeypatch.setattr(records, "git_commit", lambda: "4567def")
        with pytest.raises(ValueError, match="changed since this process loaded its code"):
            protocol.check_slice("test")
    finally:
        records.loaded_commit.cache_clear()
