"""SCD, Semantic Cache Distillation: move a producer's KV cache to a consumer as compact codes.

Modules: rrr (REUSE codes), patch (PATCH codes + aligners), quant and payload (the wire
format), plan (per-layer decisions), calibrate (fitting and the saved artefact),
transfer (the one machinery that runs any plan), evaluate (methods, analyses, tables),
bench (the benchmark of one pair, JSON records, the projection), cli (``calibrate`` and
``bench scd`` commands). The link / TTFT model is scdviz.link. Nothing runs at import time.
"""
