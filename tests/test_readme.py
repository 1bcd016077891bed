"""The README's Python example runs as written, using only scdviz's public names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import tiny_folder, user_text

import scdviz

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if "import scdviz" in b]
    assert found, "the README has no Python example importing scdviz"
    return found[0]


def test_the_readme_example_uses_only_public_names():
    code = _example()
    tree = ast.parse(code)
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.Import) and [a.name for a in n.names] == ["scdviz"] for n in imports), \
        "the example imports only `scdviz`"
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "scdviz"}
    assert used and used <= set(scdviz.__all__), sorted(used - set(scdviz.__all__))
    assert len(code.strip().splitlines()) <= 16


def _run(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "README example", "exec"), namespace)  # noqa: S102
    return namespace


def _check(ns: dict) -> None:
    ids, blob, cache = ns["ids"], ns["blob"], ns["cache"]
    assert isinstance(blob, bytes) and cache.get_seq_length() == ids.shape[1]
    table = ns["report"].table()
    assert list(table["method"])[0] == "oracle" and "SCD full" in set(table["method"])
    assert ns["press"].compression_ratio == pytest.approx(0.75)
    methods = {r["method"] for r in ns["view"].rows}
    assert {"ObservedAttention", "SnapKV", "DistillCache"} <= methods, methods  # ObservedAttention: H2O


def test_the_readme_example_runs_on_tiny_models(tmp_path, monkeypatch):
    text = user_text()
    producer, consumer = tiny_folder(tmp_path / "p", text), tiny_folder(tmp_path / "c", text)
    pair = scdviz.load_pair(str(producer), str(consumer))
    calib = scdviz.calibrate(scdviz.CalibConfig(domains=["austen", "gcide"], n_fit=4, n_select=2, prompt_len=48,
                                                cont_len=8, n_candidates=2, patch_k=2,
                                                op_patch_k=2, rate_windows=0, gate_patches=False),
                             pair, progress=False)
    calib.save(tmp_path / "calib")
    monkeypatch.setattr("scdviz.scd.codec.shipped_folder", lambda source: tmp_path / "calib")
    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    code = (_example().replace('"builtin:smollm2-135m"', repr(str(producer)))
            .replace('"builtin:jargon"', repr(str(consumer))))
    code = re.sub(r"\[:\d+\]", "[:400]", code)  # the tiny models hold 512 positions
    _check(_run(code))


@pytest.mark.slow
def test_the_readme_example_runs_on_the_built_in_pair(builtin_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path / "work"))
    ns = _run(_example())
    _check(ns)
    assert ns["pair"].consumer_facts.layers == 30
