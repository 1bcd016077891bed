"""The DistillCache scorer: a light MLP from the 5 token features to one score per token.

Features are transformed (log of the positive ones) and standardised across the tokens
of each row (one row = one layer / KV head, or the single global row), so the policy
sees relative importance and transfers across contexts and models. Inference keeps the
top-B scores (deterministic); sampling for training lives in scdviz.evict.trainer.
Weights are stored as safetensors with the config in the metadata.

Shapes: features (..., T, 5) -> scores (..., T). This module does not compute features
or touch a model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from scdviz.evict.features import N_FEATURES

_LOG_FEATURES = (0, 1, 2)  # alpha, vnorm, sigma are positive and heavy-tailed


@dataclass
class PolicyConfig:
    """Shape and scope of a policy."""

    hidden: int = 32  # width of the two hidden layers
    per_head: bool = True  # True: one token set per layer and KV head; False: one set for all layers
    window: int = 512  # W, recent queries the features are computed from


class Policy(nn.Module):
    """MLP scorer over standardised token features."""

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__()
        self.config = config or PolicyConfig()
        h = self.config.hidden
        self.mlp = nn.Sequential(nn.Linear(N_FEATURES, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))

    def forward(self, features: Tensor) -> Tensor:
        """Scores (..., T) for features (..., T, 5); higher means keep."""
        return self.mlp(standardise(features)).squeeze(-1)

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Write weights + config (and optional JSON-able ``extra``) as safetensors."""
        meta = {"config": json.dumps(asdict(self.config)), "extra": json.dumps(extra or {})}
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """Read a policy written by ``save``; ValueError if the file is missing."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"policy file not found: {path}")
        with safe_open(str(path), "pt") as fh:
            config = PolicyConfig(**json.loads(fh.metadata()["config"]))
        policy = cls(config)
        policy.load_state_dict(load_file(str(path)))
        return policy.eval()


def standardise(features: Tensor) -> Tensor:
    """Log the positive features, then z-score every feature but position across tokens."""
    x = features.float().clone()
    for idx in _LOG_FEATURES:
        x[..., idx] = (x[..., idx] + 1e-10).log()
    body = x[..., :-1]
    mean, std = body.mean(-2, keepdim=True), body.std(-2, keepdim=True)
    x[..., :-1] = (body - mean) / (std + 1e-6)
    return x


def keep_count(n_tokens: int, keep: float | int) -> int:
    """Tokens kept: a fraction (0 < keep <= 1, rounded down like kvpress) or a token count."""
    if isinstance(keep, float) and keep <= 1.0:
        if keep <= 0:
            raise ValueError(f"keep fraction must be in (0, 1], got {keep}")
        return max(1, int(n_tokens * keep))
    if int(keep) < 1:
        raise ValueError(f"keep must be at least one token, got {keep}")
    return min(int(keep), n_tokens)


def compression_ratio(keep: float) -> float:
    """kvpress's compression_ratio (fraction removed) for a kept fraction."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep fraction must be in (0, 1], got {keep}")
    return 1.0 - keep


def top_b(scores: Tensor, n_keep: int) -> Tensor:
    """Indices of the ``n_keep`` highest scores per row, in position order: (..., T) -> (..., n_keep)."""
    return scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values
