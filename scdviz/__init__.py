"""scdviz: see what happens to a KV cache moved between two models (SCD) or pruned (DistillCache).

Subpackages: ``models`` (loading pairs; the one HF-internals module), ``scd``, ``evict``;
modules: ``cli`` (commands), ``config`` (settings dataclasses), ``artefact`` (saved
calibrations and policies), ``records`` (benchmark records), ``metrics``, ``drift``,
``data``, ``plots``. Importing scdviz loads no model.
"""

__version__ = "0.1.0"
