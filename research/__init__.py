"""Research probes: measurements behind the README's choices, kept out of the scdviz package.

Each runs from the checkout as ``python -m research.NAME`` (``--help`` says what it takes), imports from
scdviz only public names (``scdviz.__all__`` and its modules' names without a leading underscore), and is
not installed with scdviz nor run by its test suite; ideas measured and not kept
(docs/history.md) live here, not in the library.

    aligner_features        leave-one-domain-out ridge maps from producer features (the aligner's limit)
    app_latency             how long a visitor waits in the app: eviction, an SCD transfer, a figure export
    compare_records         two bench scd records of the same prompts: per method, new / old KL with a paired interval
    evict_paired            joins bench evict records made on the same contexts; paired intervals vs the best baseline
    gemma_check             Gemma-3-270m's perplexity under transformers' tokenizer vs the rebuilt one
    gpu_check               the prepared GPU check: tests/test_device.py with the models on CUDA -> JSON report
    gpu_wheels.sh           fetches here the wheels the GPU machine lacks (kvpress and its imports) into .whl/
    lookahead_matched       the lookahead policy against compute-matched scorers on sampled continuations (dev)
    policy_headroom         validation KL of attention statistics, the true future attention and MLPs imitating them
    policy_lookahead        validation KL of the lookahead feature, its mixes with alpha and given policies vs H2O
    scd_floor_check         SCD's unquantised floor; maps fed neighbouring layers; other reconstructions of coded values
    student_listwise        the student's loss or its inputs: ridge vs listwise fits, window / H2O columns (validation)
    test_ledger             every run on the test slice from the git history -> docs/test_ledger.json
    transform_coding_check  SCD's transform coding vs the planner on calibration windows; where the bytes went
"""
