"""DistillCache: a learned KV-cache eviction policy (features, policy, trainer, press, decode, compare, view)."""
