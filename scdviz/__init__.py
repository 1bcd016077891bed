"""scdviz: see what happens to a KV cache moved between two models (SCD) or pruned (DistillCache).

Subpackages: ``models`` (loading pairs; the one HF-internals module), ``scd``, ``evict``;
modules: ``metrics``, ``drift``, ``data``, ``plots``. Importing scdviz loads no model.
"""

__version__ = "0.1.0"
