"""The DistillCache scorer: a light MLP from the 5 token features (6 with the lookahead) to one score per token.

Features are transformed (log of the positive ones) and standardised across the tokens
of each row (one row = one layer / KV head, or the single global row), so the policy
sees relative importance and transfers across contexts and models. Inference keeps the
top-B scores (deterministic); sampling for training lives in scdviz.evict.train.
Weights, config and the trained-on model's identity are one scdviz artefact (safetensors).

Shapes: features (..., T, F) -> scores (..., T), F >= the policy's ``n_inputs`` (extra
columns are ignored, so a 5-feature policy reads features observed with the lookahead).
This module does not compute features or touch a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from scdviz import artefact, config, settings
from scdviz.config import opt
from scdviz.evict.features import N_FEATURES, POS

KIND = "distillcache-policy"
FILE = "best.safetensors"  # the policy of a policy folder: the checkpoint chosen on validation
LOG = "log.json"  # the training log beside a policy file
SHIPPED_DIR = settings.ASSETS_DIR / "policy"  # shipped policies, one folder each
_LOG_FEATURES = (0, 1, 2, 5)  # alpha, vnorm, sigma (and the lookahead) are positive and heavy-tailed


@dataclass
class PolicyConfig:
    """Shape and scope of a policy."""

    hidden: int = opt(32, 'width of the two hidden layers')
    per_head: bool = opt(True, 'True: one token set per layer and KV head; False: one set for all layers')
    window: int = opt(512, 'W, recent queries the features are computed from')
    lookahead: int = opt(0, "G > 0: a sixth feature, the attention that continuations of G tokens the model samples "
                         "after the context pay to each token (prefill only; 0: the 5 features as specified)")
    lookahead_samples: int = opt(4, 'K, continuations sampled for the lookahead feature')
    lookahead_prior: float = opt(0.75, "lookahead policies: the score is log(prior) + the MLP's correction (zero at "
                                 "the start), prior = w x lookahead + (1 - w) x alpha, each normalised per row; this "
                                 "is w (0.75 chosen on validation: research/policy_lookahead.py); 0: no prior")

    @property
    def n_inputs(self) -> int:
        """Feature columns the policy reads."""
        return N_FEATURES + (1 if self.lookahead else 0)

    @property
    def observation(self) -> tuple[int, int, int]:
        """What a prefill must observe for this policy: (W, G, K); policies that agree share one."""
        return (self.window, self.lookahead, self.lookahead_samples if self.lookahead else 0)


class Policy(nn.Module):
    """MLP scorer over standardised token features."""

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__()
        self.config = config or PolicyConfig()
        self.identity: dict = {}  # the model it was trained on (source, weight fingerprint)
        self.meta: dict = {}  # what its training recorded (steps, validation KL)
        self.log: dict | None = None  # its training log (log.json beside its file), when known
        h = self.config.hidden
        self.mlp = nn.Sequential(nn.Linear(self.config.n_inputs, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(),
                                 nn.Linear(h, 1))
        if self.has_prior:  # a new policy scores exactly as its prior; training learns the correction
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)

    @property
    def has_prior(self) -> bool:
        """Whether the score adds a lookahead prior to the MLP's output."""
        return bool(self.config.lookahead and self.config.lookahead_prior)

    def forward(self, features: Tensor) -> Tensor:
        """Scores (..., T) for features (..., T, F >= n_inputs); higher means keep."""
        n = self.config.n_inputs
        if features.shape[-1] < n:
            raise ValueError(
                f"this policy reads the lookahead feature (continuations of {self.config.lookahead} tokens sampled "
                "after the prefill), which only a full prefill observes (scdviz.evict.context.observe with "
                "lookahead); kvpress's layer-by-layer hooks and decode-time eviction cannot give it: use a "
                "5-feature policy there")
        x = features[..., :n]
        out = self.mlp(standardise(x)).squeeze(-1)
        return out + lookahead_prior(x, self.config.lookahead_prior) if self.has_prior else out

    def save(self, path: str | Path, identity: dict | None = None, meta: dict | None = None) -> Path:
        """Write weights, config, the trained-on model's ``identity`` and ``meta`` (scdviz.artefact).

        ``path``: a ``.safetensors`` file, or a folder: then ``folder/best.safetensors`` (the file a
        policy folder is read by; ``meta`` defaults to the policy's own) and, when the policy
        carries its training log, ``folder/log.json`` beside it. Returns what was written (the
        file, or the folder)."""
        path = Path(path)
        if path.suffix == ".safetensors":
            return artefact.save(path, KIND, self.state_dict(), identity or self.identity, config.to_dict(self.config),
                                 meta)
        self.save(path / FILE, identity, self.meta if meta is None else meta)
        if self.log is not None:
            (path / LOG).write_text(json.dumps(self.log, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, pair=None) -> Policy:
        """Read a policy written by ``save``: a file, or a folder (its ``best.safetensors``, the
        checkpoint chosen on validation); ``log`` is the training log beside the file (None without one).

        On the host, or with ``pair`` (a ``Pair``) on its device. ``identity`` tells which model it
        was trained on; applying it to another model is the zero-shot transfer the benchmarks
        measure, so no model is refused here.
        """
        path = Path(path)
        if path.suffix != ".safetensors" and not path.is_file():
            path = path / FILE
        art = artefact.load(path, KIND)
        cfg, _ = config.from_dict(PolicyConfig, art.config, str(path))
        policy = cls(cfg)
        try:
            policy.load_state_dict(art.tensors)
        except RuntimeError as err:
            raise ValueError(f"{path}: weights do not fit its config ({str(err).splitlines()[0][:200]})") from None
        policy.identity, policy.meta = art.identity, art.meta
        log = path.with_name(LOG)
        policy.log = json.loads(log.read_text()) if log.is_file() else None
        if pair is not None:
            policy = policy.to(pair.device)
        return policy.eval()

    @classmethod
    def shipped(cls, name: str = "global", pair=None) -> Policy:
        """A policy shipped in ``assets/policy/NAME`` (its checkpoint chosen on validation);
        ValueError naming the shipped ones for another name."""
        names = sorted(p.parent.name for p in SHIPPED_DIR.glob(f"*/{FILE}"))
        if name not in names:
            raise ValueError(f"no shipped policy named {name!r}; shipped: {', '.join(names)}")
        return cls.load(SHIPPED_DIR / name, pair)


def standardise(features: Tensor) -> Tensor:
    """Log the positive features, then z-score every feature but position across tokens."""
    x = features.float().clone()
    for idx in _LOG_FEATURES:
        if idx < x.shape[-1]:
            x[..., idx] = (x[..., idx] + 1e-10).log()
    body = [i for i in range(x.shape[-1]) if i != POS]
    part = x[..., body]
    x[..., body] = (part - part.mean(-2, keepdim=True)) / (part.std(-2, keepdim=True) + 1e-6)
    return x


def lookahead_prior(features: Tensor, weight: float) -> Tensor:
    """log(w x lookahead + (1 - w) x alpha), each normalised to sum 1 over the tokens: (..., T, 6) -> (..., T)."""
    def share(x):
        return x / x.sum(-1, keepdim=True).clamp_min(1e-12)

    look, alpha = features[..., N_FEATURES].float(), features[..., 0].float()
    return (weight * share(look) + (1 - weight) * share(alpha) + 1e-12).log()


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


# ----------------------------------------------------------------------------- sampling kept sets


def plackett_luce_logprob(scores: Tensor, ranking: Tensor) -> Tensor:
    """Exact log-probability of drawing ``ranking`` (..., B) first-to-last from scores (..., T).

    P = prod_k exp(s_(k)) / sum_{j not in ranking[:k]} exp(s_j). Computed stably as
    logaddexp(logsumexp over never-chosen tokens, reverse logcumsumexp of the chosen).
    """
    chosen = scores.gather(-1, ranking)  # (..., B)
    mask = torch.ones_like(scores, dtype=torch.bool).scatter(-1, ranking, False)
    rest = scores.masked_fill(~mask, float("-inf")).logsumexp(-1, keepdim=True)  # (..., 1)
    tail = chosen.flip(-1).logcumsumexp(-1).flip(-1)  # logsumexp of chosen[k:]
    return (chosen - torch.logaddexp(tail, rest)).sum(-1)


def gumbel_top_b(scores: Tensor, n_keep: int, generator: torch.Generator | None = None) -> Tensor:
    """A Plackett-Luce sample of the first ``n_keep`` of a ranking: (..., T) -> (..., B), best first."""
    u = torch.rand(scores.shape, generator=generator, device=scores.device).clamp(1e-10, 1 - 1e-10)
    gumbel = -(-u.log()).log()
    return (scores.detach() + gumbel).topk(n_keep, dim=-1).indices
