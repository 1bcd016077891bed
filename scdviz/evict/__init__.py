"""DistillCache: a learned KV-cache eviction policy.

What a user holds: ``policy.Policy`` (the scorer, ``save`` / ``load`` / ``shipped``), made by
``train.train(cfg, pair, callback)``, and ``press.DistillCachePress`` (the policy as a kvpress
press); ``bench.run(cfg, pair)`` gives a ``BenchRecord``, ``view.eviction_view`` one context
through every method. Underneath: features (the 5 attention features), context (one eager
prefill serving every method), decode (eviction while decoding), windows (sliding-window layers are
never compressed: the one rule every entry point asks) and kvpress_limits (kvpress presses refused on
families whose attention they would rebuild wrongly).
"""
