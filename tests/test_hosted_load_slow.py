"""The hosted app's memory over a mixed load returns to a bounded baseline, and no request holds a worker for
long (issue 59): research/hosted_load.py's measurement, shortened (the docs give its 200-request run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_memory_returns_to_a_bounded_baseline_over_a_mixed_load():
    from research.hosted_load import run_load

    out = run_load(40, seed=1)
    assert len(out["rss"]) == 40 and all(out["seconds"].values())  # every kind ran
    assert out["rss"][-1] <= 1.5 * out["baseline"], (out["rss"][-1] / 2**20, out["baseline"] / 2**20)
    slowest = max(max(times) for times in out["seconds"].values())
    assert slowest < 60, out["seconds"]
