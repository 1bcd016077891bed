"""The specialist frontier table (``report scd-frontier``): what its cells say of a recipe and its line."""

from __future__ import annotations

from scdviz import records, report


def _row(label: str, layers: list[int], oracle: list[float], raw: list[float], top1: float, ppl: float) -> dict:
    n = len(oracle)
    return {"label": label, "passages": [f"austen:{i}" for i in range(n)], "question": "before",
            "qa_f1_producer": [0.1] * n, "qa_f1_oracle": oracle, "qa_f1_raw": raw, "top1_raw": top1,
            "kl_raw_mean": 0.5, "ppl_producer": 40.0, "ppl_oracle": ppl, "ppl_raw": 50.0,
            "recipe": {"config": {"corpus": "austen", "task": "before", "text_loss": 0.3, "rank": 16, "lr": 0.002,
                                  "steps": 300, "layers": layers, "targets": ["k_proj", "v_proj"]},
                       "adapter_bytes": 3_000_000}}


def _cells(monkeypatch, rows: list[dict]) -> list[list[str]]:
    rec = records.BenchRecord("scd", {}, 0, rows)
    monkeypatch.setattr(report, "shipped_record", lambda rel: rec)
    lines = report.scd_frontier().split("\n\n")[0].splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_adapter_cell_names_the_adapted_layers(monkeypatch):
    good, raw = [0.5, 0.6, 0.4, 0.5], [0.1, 0.2, 0.1, 0.1]
    cells = _cells(monkeypatch, [_row("every", [], good, raw, 0.5, 60.0), _row("upper", list(range(15, 30)),
                                 good, raw, 0.5, 60.0), _row("some", [3, 7], good, raw, 0.5, 60.0)])
    adapters = [c[2] for c in cells]
    assert adapters[0].startswith("k v, rank 16")  # every layer: no span named
    assert adapters[1].startswith("k v in layers 15–29, rank 16")
    assert adapters[2].startswith("k v in layers 3 7, rank 16")
    assert all(c[1] == "before + its text × 0.3 on austen" for c in cells)


def test_raw_reuse_line_needs_all_three_parts(monkeypatch):
    good, low, high = [0.5, 0.6, 0.4, 0.5], [0.1, 0.2, 0.1, 0.1], [0.45, 0.5, 0.4, 0.45]
    cells = _cells(monkeypatch, [
        _row("meets", [], good, low, 0.55, 60.0),  # share 0.25, top-1 0.55, gain 5x, perplexity 1.5x
        _row("forgets the text", [], good, low, 0.55, 90.0),  # the same past twice the producer's perplexity
        _row("top-1 too high", [], good, low, 0.65, 60.0),
        _row("raw keeps too much", [], good, high, 0.55, 60.0),  # share 0.9
    ])
    assert [c[-1] for c in cells] == ["yes", "yes, but the specialist no longer models the text", "no", "no"]
    assert cells[0][6].startswith("0.25×")  # raw ÷ specialist: the ratio of pooled means
    assert cells[0][5].startswith("5.00×")  # specialist ÷ producer
