"""Figures and tables people can read: several records overlaid, no text piles, rounded display,
raw exports. Pure functions on small made-up records plus the shipped ones; no models."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pandas as pd
import pytest

from scdviz import plots, records, settings
from scdviz.app import results
from scdviz.app.inputs import UserError


def scd_record(scale: float = 1.0, prompt_len: int = 256) -> records.BenchRecord:
    rows = [{"row": "measured", "group": "method", "method": "oracle", "payload_bytes_per_token": 0.0, "kl": 0.0}]
    for i, method in enumerate(("raw KV", "4-bit KV", "SCD reuse-only", "SCD full")):
        rows.append({"row": "measured", "group": "method", "method": method, "payload_bytes_per_token": 7000.0 + i,
                     "kl": scale * (0.03 + 0.001 * i), "kl_se": 0.005, "top1": 0.9, "kl_per_prompt": [0.1, 0.2]})
    rows += [{"row": "measured", "group": "patch sweep", "method": f"SCD k={k} (greedy)",
              "payload_bytes_per_token": 6824.76 + 113.6 * k, "kl": scale * 0.0313} for k in range(7)]
    rows.append({"row": "projection", "method": "raw KV", "label": "analytic projection, not a measurement"})
    settings_ = {"producer": "builtin:smollm2-135m", "bench": {"prompt_len": prompt_len, "cont_len": 32}}
    return records.BenchRecord("scd", settings_, 0, rows, {"torch": "2.5"}, "2026-01-01T00:00:00Z")


def evict_record(scale: float = 1.0) -> records.BenchRecord:
    rows = [{"model": "builtin:smollm2-135m", "mode": "agnostic", "method": m, "keep": keep, "tokens_kept": 512 * keep,
             "kl": scale * (i + 1) / keep / 100, "top1": 0.8}
            for i, m in enumerate(("DistillCache-per-head", "SnapKV", "TOVA"))
            for keep in (0.5, 0.125, 0.25)]
    rows.append({"model": "builtin:smollm2-135m", "mode": "agnostic", "method": "full cache", "keep": 1, "kl": None})
    return records.BenchRecord("evict", {"eval": {"limit": 12, "keeps": [0.25, 0.125]}}, 0, rows)


def ttft_record() -> records.BenchRecord:
    rows = [{"method": "oracle", "oracle_ms": 4156.4}]
    rows += [{"method": m, "oracle_ms": 4156.4, "bytes_per_token": b,
              **{f"ttft_{g}gbps_ms": t / g ** 0.1 for g in (1, 10, 100)},
              **{f"ttft_with_prefill_{g}gbps_ms": 4000 + t for g in (1, 10, 100)}}
             for m, b, t in (("raw KV", 23018.3, 362.6), ("SCD full", 6969.9, 870.3))]
    return records.BenchRecord("ttft", {"ttft": {"repeats": 2}}, 0, rows)


def groups(fig) -> set[str]:
    return {t.legendgroup for t in fig.data if t.legendgroup}


def test_two_records_of_one_kind_share_one_plot_with_a_legend_group_each():
    figs = plots.record_figures([("run A", scd_record()), ("run B", scd_record(2.0, 512))])
    assert list(figs) == ["payload_vs_kl"]  # only the kind present
    fig = figs["payload_vs_kl"]
    assert groups(fig) == {"run A", "run B"}
    for label in ("run A", "run B"):
        mine = [t for t in fig.data if t.legendgroup == label]
        assert [t.legendgrouptitle.text for t in mine if t.legendgrouptitle.text] == [label]  # one title per record
        assert len({t.marker.symbol for t in mine}) == 1  # a record keeps its marker...
    assert len({t.marker.symbol for t in fig.data}) == 2  # ...and records differ
    colors = {(t.legendgroup, t.name): t.marker.color for t in fig.data}
    assert colors[("run A", "SCD full")] == colors[("run B", "SCD full")]  # a method keeps its colour
    # the oracle (0 bytes) and the analytic projection (no KL) are not points
    names = {t.name for t in fig.data}
    assert "oracle" not in names and {"raw KV", "SCD full", "patch sweep"} <= names
    sweep = next(t for t in fig.data if t.legendgroup == "run B" and t.name == "patch sweep")
    assert len(sweep.x) == 7 and "SCD k=3 (greedy)" in sweep.hovertext[3] and "record: run B" in sweep.hovertext[3]


def test_a_kl_at_float_noise_is_not_a_point_on_the_log_axis():
    """A plan that recomputes every adapted layer matches the oracle to float noise (austen-before's DroidSpeak
    k=16: KL 1.1e-7); drawn, it would stretch the log axis over five decades below every other point."""
    rec = scd_record()
    rec.rows.append({"row": "measured", "group": "DroidSpeak sweep", "method": "DroidSpeak k=16",
                     "payload_bytes_per_token": 11863.5, "kl": 1.1e-7})
    fig = plots.record_figures([("run", rec)])["payload_vs_kl"]
    ys = [y for t in fig.data for y in t.y]
    assert min(ys) > plots.KL_EXACT and "DroidSpeak sweep" not in {t.name for t in fig.data}
    shipped = plots.record_figures([("b", records.read(settings.ASSETS_DIR / "scd" / "austen-before" / "bench.json"))])
    assert min(y for t in shipped["payload_vs_kl"].data for y in t.y) > 0.01


def test_no_record_figure_writes_text_on_points():
    """Points cluster (seven patch-sweep points within 800 B/token): labels go to the legend and the hover."""
    labelled = [(p.stem, records.read(p)) for p in results.shipped_results()]
    figs = plots.record_figures(labelled)
    assert set(figs) == {"payload_vs_kl", "kl_vs_budget", "ttft"}
    for name, fig in figs.items():
        assert fig.data, name
        for trace in fig.data:
            assert "text" not in (trace.mode or ""), (name, trace.name, trace.mode)
            assert not fig.layout.annotations, name
        assert all(t.hovertext or t.hovertemplate for t in fig.data), name
        assert fig.layout.legend.orientation == "v" and fig.layout.height >= 480  # every entry shown
    assert len(groups(figs["payload_vs_kl"])) == sum(rec.kind == "scd" for _, rec in labelled)


def test_record_figures_take_one_record_and_mixed_kinds():
    one = plots.record_figures([("solo", evict_record())])
    assert list(one) == ["kl_vs_budget"]
    lines = one["kl_vs_budget"].data
    assert {t.name for t in lines} == {"DistillCache-per-head", "SnapKV", "TOVA"}  # the full cache has no KL
    assert all(list(t.x) == sorted(t.x) == [12.5, 25.0, 50.0] for t in lines)  # sorted by budget
    assert len({t.marker.symbol for t in lines}) == 3  # one record: a marker per method
    mixed = plots.record_figures([("s", scd_record()), ("e", evict_record()), ("t", ttft_record())])
    assert list(mixed) == ["payload_vs_kl", "kl_vs_budget", "ttft"]
    ttft = mixed["ttft"]
    assert {t.name for t in ttft.data} == {"raw KV", "SCD full", "oracle prefill"}
    assert list(ttft.data[0].x) == [1, 10, 100]
    assert plots.record_figures([]) == {}


def test_repeated_labels_become_unique():
    figs = plots.record_figures([("bench", scd_record()), ("bench", scd_record(2.0))])
    assert groups(figs["payload_vs_kl"]) == {"bench", "bench (2)"}
    assert plots.unique_labels(["a", "a", "a (2)", "a"]) == ["a", "a (2)", "a (2) (2)", "a (3)"]


def test_settings_diff_lists_only_what_differs_flattened():
    a, b = scd_record(), scd_record(prompt_len=512)
    diff = plots.settings_diff([("A", a), ("B", b)])
    assert list(diff.columns) == ["setting", "A", "B"]
    assert diff["setting"].tolist() == ["bench.prompt_len"]
    assert diff.iloc[0].tolist() == ["bench.prompt_len", "256", "512"]
    b.versions = {"torch": "2.6", "hardware": {"cpu_count": 16}}
    diff = plots.settings_diff([("A", a), ("B", b)])
    assert diff["setting"].tolist() == ["bench.prompt_len", "versions.torch", "versions.hardware.cpu_count"]
    assert diff.set_index("setting").loc["versions.hardware.cpu_count"].tolist() == ["—", "16"]
    alone = plots.settings_diff([("A", a)]).set_index("setting")["A"]  # one record: every setting
    assert (alone["bench.cont_len"] == "32" and alone["producer"] == "builtin:smollm2-135m"
            and alone["record.kind"] == "scd")


def test_rounding_for_display_only():
    assert plots.round_sig(0.089438647031784) == 0.08944
    assert plots.round_sig(22952.760784313727) == 22953.0  # digits before the point are kept
    assert plots.round_sig(1.0038008157931) == 1.004
    assert plots.round_sig(3) == 3 and plots.round_sig("x") == "x" and math.isnan(plots.round_sig(float("nan")))
    df = pd.DataFrame({"kl": [0.089438647031784, None], "n": [16, 3], "method": ["a", "b"], "mixed": [1.23456789, "t"]})
    shown = plots.rounded(df)
    assert shown["kl"].iloc[0] == 0.08944 and shown["n"].tolist() == [16, 3] and shown["mixed"].tolist() == [1.235, "t"]
    assert df["kl"].iloc[0] == 0.089438647031784  # the original is untouched


def test_results_view_rounds_the_table_and_exports_raw_values(monkeypatch, tmp_path):
    from scdviz.app import session

    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    records.write(scd_record(), a)
    records.write(evict_record(), b)
    out = results.compare_results(["assets/scd/jargon/bench.json"], [str(a), str(b)], [], session.Session())
    assert set(out["figures"]) == {"payload_vs_kl", "kl_vs_budget"}
    assert groups(out["figures"]["payload_vs_kl"]) == {"scd/jargon/bench", "a"}
    shown, raw = out["table"], pd.read_csv(out["csv"])
    assert shown.columns[0] == "record" and set(shown["record"]) == {"scd/jargon/bench", "a", "b"}
    assert "kl_per_prompt" not in shown and "kl_per_prompt" in raw  # lists: in the CSV only
    kl_raw = raw[(raw["record"] == "scd/jargon/bench") & (raw["method"] == "raw KV")]["kl"].iloc[0]
    kl_shown = shown[(shown["record"] == "scd/jargon/bench") & (shown["method"] == "raw KV")]["kl"].iloc[0]
    shipped = json.loads((settings.ASSETS_DIR / "scd" / "jargon" / "bench.json").read_text())["rows"]
    want = next(r["kl"] for r in shipped if r["method"] == "raw KV")
    assert kl_raw == pytest.approx(want, abs=1e-15) and kl_shown == round(want, 5)
    assert set(raw["bench_kind"]) == {"scd", "evict"}
    assert "3 records" in out["info"] and "plotted separately" in out["info"]
    # the export reads back as the same records, split by record and kind
    back = results.read_records(out["csv"])
    assert [(label, rec.kind, len(rec.rows)) for label, rec in back] == [
        ("results:scd/jargon/bench", "scd", len(shipped)), ("results:a", "scd", 13), ("results:b", "evict", 10)]
    with pytest.raises(UserError, match="this one holds evict, scd"):
        results.load_results(out["csv"])  # one frame of one kind: the old single-file reader refuses it
    empty = results.compare_results([], None, [], session.Session())
    assert empty["figures"] == {} and "Choose" in empty["info"]


def test_open_records_refuses_bad_choices_with_a_message(monkeypatch, tmp_path):
    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path))
    with pytest.raises(UserError, match="'nope.json' is not a shipped record"):
        results.open_records(["nope.json"])
    with pytest.raises(UserError, match="no bench run named 'ghost'"):
        results.open_records(local=["ghost"])
    with pytest.raises(UserError, match="open at most 12 records"):
        results.open_records(list(results.shipped_records()) * 2)
    with pytest.raises(UserError, match="expected a list of names"):
        results.open_records([1, 2])
    folder = tmp_path / "runs" / "bench" / "mine"
    folder.mkdir(parents=True)
    records.write(evict_record(), folder / "record.json")
    assert list(results.local_records()) == ["mine"]
    ((label, rec),) = results.open_records(local=["mine"])
    assert label == "mine" and rec.kind == "evict"
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    assert results.local_records() == {}  # hosted visitors never see the machine's runs
    with pytest.raises(UserError, match="does not read the runs folder"):
        results.open_records(local=["mine"])
    with pytest.raises(UserError, match="does not read local paths"):
        results.open_records(uploads=[str(folder / "record.json")])


def test_single_file_reader_keeps_its_behaviour(tmp_path):
    (path,) = settings.ASSETS_DIR.glob("scd/jargon/bench.json")
    df, kind = results.load_results(path)
    assert kind == "scd" and len(df) == len(json.loads(path.read_text())["rows"])
    csv = tmp_path / "x.csv"
    df.assign(bench_kind=kind).to_csv(csv, index=False)
    again, kind = results.load_results(csv)
    assert kind == "scd" and list(again.columns) == list(df.columns)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="needs one bench_kind"):
        results.load_results(tmp_path / "bad.csv")


def _result(method, modes, drift):
    return SimpleNamespace(method=method, modes=modes, drift_k=drift, drift_v=drift, divergence=drift)


def test_patched_layers_get_one_legend_entry_and_no_overlapping_labels():
    modes = ["code"] * 30
    for layer in (23, 24, 27):
        modes[layer] = "patch"
    fig = plots.layer_drift([_result("SCD full", modes, [0.01] * 30), _result("raw KV", ["code"] * 30, [0.02] * 30)])
    assert not fig.layout.annotations  # no text on the plot
    assert [(s.x0, s.x1) for s in fig.layout.shapes] == [(22.5, 24.5), (26.5, 27.5)]  # neighbours merged
    marks = [t for t in fig.data if t.name.startswith("patched")]
    assert len(marks) == 1 and "23, 24, 27" in marks[0].name
    assert fig.layout.legend.yanchor == "top"  # the legend grows downwards, away from the axis title


def test_scd_tab_pareto_has_no_text_and_groups_specialists():
    table = pd.DataFrame({"group": ["method"] * 4, "method": ["oracle", "raw KV", "SCD full", "SCD full"],
                          "bytes_per_token": [0, 22952.8, 7052.0, 7052.0], "kl": [0, 0.1, 0.03, 0.04],
                          "specialist": ["jargon", "jargon", "jargon", "bible"]})
    fig = plots.pareto(table)
    assert all("text" not in t.mode for t in fig.data)
    assert {(t.legendgroup, t.name) for t in fig.data} == {("jargon", "raw KV"), ("jargon", "SCD full"),
                                                          ("bible", "SCD full")}
    single = plots.pareto(table[table["specialist"] == "jargon"])
    assert {t.name for t in single.data} == {"raw KV", "SCD full"} and not any(t.legendgroup for t in single.data)
    assert "method: SCD full" in single.data[1].hovertext[0]


def test_the_compute_axis_puts_each_method_at_its_share_of_the_prefill():
    """One point per method at (prefill_share, KL); the oracle (all compute, no error) is left out."""
    table = pd.DataFrame({"method": ["oracle", "raw KV", "DroidSpeak recompute", "SCD reuse-only + last 64 recomputed"],
                          "prefill_share": [1.0, 0.0, 0.067, 0.233], "kl": [0.0, 0.23, 0.2, 0.078],
                          "bytes_per_token": [0, 22953, 21423, 5574], "top1": [1, 0.75, 0.76, 0.83]})
    fig = plots.compute_axis(table)
    points = {t.name: (t.x[0], t.y[0]) for t in fig.data}
    assert points == {"raw KV": (0.0, 0.23), "DroidSpeak recompute": (0.067, 0.2),
                      "SCD reuse-only + last 64 recomputed": (0.233, 0.078)}
    assert "share of the prefill: 0.233" in fig.data[2].hovertext[0]
    assert fig.layout.xaxis.tickformat == ".0%"  # the share as a percentage of the prefill
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.dtick == "D2"  # KL labelled at 1, 2, 5 per decade


def test_many_methods_get_distinct_colours():
    sweep = {f"method {i}": {0.25: 0.1 * (i + 1), 0.5: 0.05 * (i + 1)} for i in range(13)}
    fig = plots.budget_sweep(sweep)
    palette = fig.layout.colorway
    assert len(set(palette[:13])) == 13
    assert len({t.marker.symbol for t in fig.data}) == 13


def test_results_refuse_files_too_large_in_rows_columns_or_nesting(monkeypatch, tmp_path):
    monkeypatch.setattr(results, "MAX_ROWS", 50)
    rows = tmp_path / "rows.csv"
    pd.DataFrame({"bench_kind": ["evict"] * 51, "kl": range(51)}).to_csv(rows, index=False)
    with pytest.raises(UserError, match="rows.csv holds more than 50 rows"):
        results.read_records(rows, (tmp_path,))
    wide = tmp_path / "wide.csv"
    pd.DataFrame({f"c{i}": [1] for i in range(results.MAX_COLUMNS + 1)}).to_csv(wide, index=False)
    with pytest.raises(UserError, match=f"wide.csv has {results.MAX_COLUMNS + 1} columns"):
        results.read_records(wide, (tmp_path,))
    many = tmp_path / "many.json"
    records.write(records.BenchRecord("evict", {}, None, [{"method": "x", "kl": i} for i in range(51)]), many)
    with pytest.raises(UserError, match="many.json holds more than 50 rows"):
        results.read_records(many, (tmp_path,))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(UserError, match="nests its JSON too deeply"):
        results.read_records(deep, (tmp_path,))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(UserError, match="empty CSV"):
        results.read_records(empty, (tmp_path,))


def test_a_tabs_figures_download_as_one_page_with_plotly_once(monkeypatch, tmp_path):
    from scdviz.app import session

    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path))
    figs = plots.record_figures([("a", scd_record()), ("b", evict_record())])
    figs = {f"{name}_{i}": fig for i in range(5) for name, fig in figs.items()}  # ten figures, as the SCD tab
    [page] = results.export_figures(figs, session.Session(), "scd")
    text = open(page, encoding="utf-8").read()
    assert page.endswith("scdviz-scd.html") and text.count("<h2>") == 10
    assert text.count("Plotly.newPlot") == 10 and text.count("plotly.js v") <= 2  # the library once (its banner)
    assert os.path.getsize(page) < 10 * 2**20
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    with pytest.raises(UserError, match="one HTML page"):
        results.export_figures(figs, session.Session(), "scd", static=True)


def test_a_method_looks_the_same_in_every_plot_and_focus_fades_the_rest():
    steps = {m: [0.1, 0.2] for m in ("KVzip", "SnapKV", "ObservedAttention", "yours:mine")}
    sweep = {m: {0.25: 0.1, 0.5: 0.05} for m in ("SnapKV", "yours:mine", "ObservedAttention", "KVzip")}  # other order
    a, b = plots.kl_per_step(steps), plots.budget_sweep(sweep)
    for fig_a in (a,):
        for t in fig_a.data:
            u = next(x for x in b.data if x.name == t.name)
            assert (t.line.color, t.marker.symbol) == (u.line.color, u.marker.symbol), t.name
    looks = {plots.look(m)[:2] for m in plots.EVICT_METHODS}
    assert len(looks) == len(plots.EVICT_METHODS)  # no two eviction methods alike
    assert len({plots.look(m)[:2] for m in plots.SCD_METHODS}) == len(plots.SCD_METHODS)
    assert plots.look("SCD RD @3840 B/token") == plots.look("SCD RD")
    plots.paint(b, focus={"SnapKV"})
    width = {t.name: (t.line.width, t.opacity) for t in b.data}
    assert width["SnapKV"] == (plots.FOCUS_WIDTH, 1.0)
    assert width["KVzip"] == (plots.CONTEXT_WIDTH, plots.CONTEXT_OPACITY)
    assert plots.best_other({"SCD full": 0.1, "raw KV": 0.5, "DroidSpeak recompute": 0.3, "oracle": 0.0},
                            {"SCD full", "oracle"}) == "DroidSpeak recompute"


def _luminance(color: str) -> float:
    """WCAG relative luminance of a ``#rrggbb`` colour (0 black, 1 white)."""
    channels = [int(color.lstrip("#")[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _on_white(color: str, opacity: float) -> str:
    """The colour a trace drawn at ``opacity`` shows on the white plot background."""
    channels = [int(color.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4)]
    return "#" + "".join(f"{round(opacity * c + (1 - opacity) * 255):02x}" for c in channels)


def test_every_painted_trace_is_clearly_visible_and_focus_stays_stronger():
    """No painted method is white or near-white, a hollow marker or too faint, faded or not (the SCD tab's
    "SCD reuse-only (closed form)" was a pale open ring, the eviction tab's KVzip and StreamingLLM pale
    lines); the focus methods stay wider and opaque."""
    floor = 0.55  # the lowest opacity a painted trace may have
    evict = list(plots.EVICT_METHODS) + ["yours:mine", "lodo-austen", "full cache"]
    scd = list(plots.SCD_METHODS) + ["SCD reuse-only (closed form)", "SCD full (closed form)",
                                     "SCD RD @3840 B/token", "SCD reuse-only + last 64 recomputed", "oracle"]
    table = pd.DataFrame({"method": scd, "bytes_per_token": [100.0 * (i + 1) for i in range(len(scd))],
                          "kl": [0.01 * (i + 1) for i in range(len(scd))],
                          "prefill_share": [0.01 * i for i in range(len(scd))]})
    figs = {
        "kl_steps": (plots.kl_per_step({m: [0.1, 0.2] for m in evict}), {"distilled-scorer", "KVzip"}),
        "sweep": (plots.budget_sweep({m: {0.25: 0.1, 0.5: 0.05} for m in evict}), {"distilled-scorer", "SnapKV"}),
        "pareto": (plots.pareto(table), {"SCD full", "raw KV"}),
        "compute": (plots.compute_axis(table), {"SCD full", "raw KV"}),
        "drift": (plots.layer_drift([_result(m, ["code"] * 4, [0.1] * 4) for m in scd]), {"SCD full"}),
    }
    for name, (fig, focus) in figs.items():
        plots.paint(fig, focus)
        painted = [t for t in fig.data if t.name and not t.name.startswith(("patched", "oracle ("))]
        assert len(painted) >= 5, name
        for t in painted:
            where = (name, t.name)
            for color in (t.line.color, t.marker.color):
                assert color and color.startswith("#") and len(color) == 7, where
                assert _luminance(color) <= 0.5, (where, color)  # never white or pale
                assert _luminance(_on_white(color, t.opacity)) <= 0.7, (where, color, t.opacity)  # faded: still seen
            assert t.opacity >= floor, where
            assert not str(t.marker.symbol).endswith(("-open", "-open-dot")), where  # filled markers only
            strong = t.name in focus or t.name in ("oracle", "full cache")
            assert (t.opacity, t.line.width) == ((1.0, plots.FOCUS_WIDTH) if strong else
                                                 (plots.CONTEXT_OPACITY, plots.CONTEXT_WIDTH)), where
    assert plots.FOCUS_WIDTH > plots.CONTEXT_WIDTH and plots.CONTEXT_OPACITY < 1.0  # focus stays stronger
    assert all(_luminance(c) <= 0.5 for c in plots.COLORS) and not any("open" in s for s in plots.SYMBOLS)
