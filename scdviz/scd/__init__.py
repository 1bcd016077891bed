"""SCD, Semantic Cache Distillation: move a producer's KV cache to a consumer as compact codes.

Modules: rrr (REUSE codes), patch (PATCH codes + aligners), quant and payload (the wire
format), plan (every per-layer decision: lineup, operating point, rank budgets, sweeps),
calibrate (fitting and the saved artefact), transfer (the one machinery that runs any
plan), measure (plans on the same prompts, analyses, tables), bench (``bench scd`` and the
SCD tab's one-text run, rows, the projection). The link / TTFT model is scdviz.link; the
commands are in scdviz.cli. Nothing runs at import time.
"""
