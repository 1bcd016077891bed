"""SCD, Semantic Cache Distillation: move a producer's KV cache to a consumer as compact codes.

What a user holds: ``codec.Codec`` (a plan and its calibration: ``encode`` / ``encode_kv`` ->
bytes, ``decode`` -> the consumer's cache) and ``calibration.Calibration`` (the fitted artefact,
``save`` / ``load``), made by ``calibrate.calibrate(cfg, pair)``; ``bench.run(cfg, pair)`` gives a
``BenchRecord``, ``view.transfer_view`` one text through every method.

Underneath: rrr (REUSE codes), patch (PATCH codes + aligners), quant, entropy and payload (the
wire format), rate (rate-distortion curves), plan (every per-layer decision: lineup, operating
point, rank budgets, sweeps), transfer (the one machinery that runs any plan), measure (plans on
the same prompts, analyses, tables), ttft and scale (timing). The link / TTFT model is
scdviz.link; the commands are in scdviz.cli. Nothing runs at import time.
"""
