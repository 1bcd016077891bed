"""DistillCache: a learned KV-cache eviction policy (features, policy, train, press, decode, bench, view)."""
