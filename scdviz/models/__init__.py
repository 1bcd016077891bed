"""Model access: load pairs (built-in, local, hub, LoRA), check compatibility, capture tensors.

``hf`` is the only module in scdviz that touches transformers internals.
"""

from scdviz.models.pair import ModelFacts, Pair, PairError, check_compatible, load_model, load_pair, mismatches

__all__ = ["ModelFacts", "Pair", "PairError", "check_compatible", "load_model", "load_pair", "mismatches"]
