"""scdviz: see what happens to a KV cache moved between two models (SCD) or pruned (DistillCache).

The public API is ``__all__`` below; everything else is internal. Importing scdviz loads no
model and no torch: each name is imported on first use.

Pairs and data
  ``load_pair(producer, consumer) -> Pair``: two compatible causal LMs (``builtin:NAME``, a folder,
  a LoRA folder or a hub id) with their tokenizer; ``PairError`` names every mismatch.
  ``load_split(corpus, split) -> list[str]``: passages of a shipped corpus ("train" / "calib" / "eval").
SCD (semantic cache distillation)
  ``calibrate(CalibConfig(), pair) -> Calibration``; ``Calibration.save(folder)`` /
  ``Calibration.load(folder, pair=None)``. ``Codec(plan, calibration)`` or ``Codec.shipped(pair, ...)``:
  ``encode(producer, ids (1, T)) -> bytes`` and ``decode(consumer, bytes) -> DynamicCache``.
  ``Plan``: per-layer decisions (raw, code, patch, recompute) and a recomputed tail of prompt tokens
  (``Codec.shipped(pair, tail=32)``: the consumer runs the last 32 itself). ``transfer_view(pair, codec, text)``:
  every method and baseline on one text.
DistillCache (learned eviction)
  ``train(TrainConfig(), pair, callback=None) -> Policy``; ``Policy.save(folder)`` /
  ``Policy.load(path)``; ``DistillCachePress.keeping(policy, keep)`` is a kvpress press;
  ``eviction_view(model, tokenizer, context, keep=0.25)`` compares it with kvpress's presses.
  ``fit_student(StudentFitConfig(), pair) -> Student``: the cheap student (linear on each layer's input,
  distilled from the future's attention, then REINFORCE); ``StudentPress.keeping(student, keep)`` is a
  kvpress press that needs no attention probabilities; ``DecodeEvictor`` holds a cache at a budget with it.
Records and figures
  ``BenchRecord`` is what every bench writes; ``read_record(path)`` reads one. ``plots``: pure
  Plotly figures from results (``plots.layer_drift(report.methods, "K")``, ``plots.budget_sweep``);
  ``figures.export(figs, folder)`` writes them as PNG, SVG and HTML; ``figures.bundle`` as one page.
Progress
  ``calibrate``, ``train`` and the views take ``progress``: True (tqdm), False, or a callable
  ``report(step, done, total)`` told every step; raising ``Stopped`` from it ends the work there.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_WHERE = {  # public name -> the module that defines it
    "load_pair": "scdviz.models.pair",
    "Pair": "scdviz.models.pair",
    "PairError": "scdviz.models.pair",
    "load_split": "scdviz.data",
    "BenchRecord": "scdviz.records",
    "read_record": "scdviz.records",
    "CalibConfig": "scdviz.scd.calibration",
    "Calibration": "scdviz.scd.calibration",
    "calibrate": "scdviz.scd.calibrate",
    "Plan": "scdviz.scd.plan",
    "Codec": "scdviz.scd.codec",
    "transfer_view": "scdviz.scd.view",
    "PolicyConfig": "scdviz.evict.policy",
    "Policy": "scdviz.evict.policy",
    "TrainConfig": "scdviz.evict.train",
    "train": "scdviz.evict.train",
    "DistillCachePress": "scdviz.evict.press",
    "Student": "scdviz.evict.student",
    "StudentPress": "scdviz.evict.student",
    "DecodeEvictor": "scdviz.evict.decode",
    "StudentFitConfig": "scdviz.evict.student_fit",
    "fit_student": "scdviz.evict.student_fit",
    "eviction_view": "scdviz.evict.view",
    "Stopped": "scdviz.progress",
}
# public name -> the name in its module
_ALIASES = {"read_record": "read", "StudentFitConfig": "FitConfig", "fit_student": "fit"}
_MODULES = ("plots", "figures")  # public submodules

__all__ = sorted([*_WHERE, *_MODULES])


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"scdviz.{name}")
    if name not in _WHERE:
        raise AttributeError(f"module 'scdviz' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), _ALIASES.get(name, name))
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
