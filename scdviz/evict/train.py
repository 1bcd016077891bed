"""REINFORCE training of the DistillCache policy (docs/design.md).

Algorithm, per training context:
  1. one eager prefill gives the token features and the full cache; the full cache's
     logits over a teacher-forced continuation are the reference;
  2. Gumbel noise on the policy's scores, top-B of the perturbed scores: a sample from
     the Plackett-Luce distribution over rankings, whose exact log-probability is
     sum_k [s_(k) - logsumexp(s over tokens not yet chosen)];
  3. M samples per context; reward R = -mean KL(P_full || P_pruned) over the
     continuation; advantage R_m - mean of the other M-1 rewards (leave-one-out);
  4. loss = -mean_m advantage_m * log P(ranking_m) - beta * entropy, with the entropy of
     softmax(scores) per row (the first-choice distribution) as the bonus.
Optional warm start: maximise the Plackett-Luce likelihood of alpha's top-B ranking (observed
attention, the alpha feature: what H2O keeps). A lookahead policy starts at its prior instead
(scdviz.evict.policy), so it needs no warm start. Prefills are cached once per context (features,
full keys/values, reference logits), so an epoch costs only the continuations.

Sliding-window layers are never compressed (``scdviz.evict.windows``): a per-head policy's rows are those of the
full-attention layers (the window layers' rows would be sampled, and rewarded, for nothing), the global features
average those layers, ``context.prune`` keeps window layers whole, and a model whose every layer is sliding is
refused.

Not here: feature maths (features.py), the press (press.py), evaluation (bench.py).
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from scdviz import artefact, metrics
from scdviz.config import opt
from scdviz.evict import windows
from scdviz.evict.context import Observed, observe, prune
from scdviz.evict.policy import FILE as POLICY_FOLDER_FILE
from scdviz.evict.policy import LOG as POLICY_LOG
from scdviz.evict.policy import Policy, PolicyConfig, gumbel_top_b, keep_count, plackett_luce_logprob
from scdviz.models import hf
from scdviz.progress import Reporter, steps

# ----------------------------------------------------------------------------- estimator maths


def loo_baseline(rewards: Tensor) -> Tensor:
    """Leave-one-out baseline (M, ...) -> (M, ...): for each sample, the mean of the other M-1
    samples' rewards (per column when each sample has several)."""
    m = rewards.shape[0]
    if m < 2:
        raise ValueError("the leave-one-out baseline needs at least 2 samples per context")
    return (rewards.sum(0, keepdim=True) - rewards) / (m - 1)


def first_choice_entropy(scores: Tensor) -> Tensor:
    """Mean entropy of softmax(scores) per row: the entropy bonus."""
    return -(torch.softmax(scores, -1) * torch.log_softmax(scores, -1)).sum(-1).mean()


def reinforce_loss(scores: Tensor, rankings: Tensor, rewards: Tensor, entropy_coef: float) -> tuple[Tensor, Tensor]:
    """REINFORCE loss with the LOO baseline and entropy bonus, and the mean entropy.

    scores (R, T) rows of one context; rankings (M, R, B); rewards (M,).
    """
    logp = plackett_luce_logprob(scores.unsqueeze(0).expand(rankings.shape[0], -1, -1), rankings).sum(-1)  # (M,)
    advantage = (rewards - loo_baseline(rewards)).detach()
    entropy = first_choice_entropy(scores)
    return -(advantage * logp).mean() - entropy_coef * entropy, entropy.detach()


# ----------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    """A training run; the run folder holds checkpoints and the log."""

    out: str = opt("", "folder for policy.safetensors, best.safetensors, optimizer.pt, log.json, written by the CLI (a "
                   "runs folder by default; train itself writes nothing)")
    corpora: tuple[str, ...] = opt(("jargon", "bible"), 'shipped corpora to draw contexts from (train split; '
                                   'validation: calib split)')
    texts: str | None = opt(None, "your text (.txt / .jsonl file, or a folder of train/calib/eval files): one more "
                            "source of contexts, beside --corpora (give --corpora with no name for your text alone)")
    contexts: int = opt(32, 'training contexts (prefilled once each)')
    spread: bool = opt(True, "draw each corpus's windows evenly through its split (as the benchmark's eval contexts "
                       "are) instead of its first ones: the train and calib splits interleave passages of one text, "
                       "so their first windows come from neighbouring parts of it (validation then flatters)")
    context_len: int = opt(512, 'T, tokens per context')
    cont_len: int = opt(24, 'teacher-forced continuation tokens for the reward')
    question_len: int = opt(16, "tokens teacher-forced between the context and the scored continuation, unscored: "
                            "bench evict's question_len, so that validation measures what the benchmark measures (0: "
                            "score the tokens right after the context)")
    keeps: tuple[float, ...] = opt((0.25, 0.125), 'kept fractions, one drawn per step')
    samples: int = opt(4, 'M, Gumbel samples per context and step (reward: -mean KL over the continuation)')
    steps: int = opt(300, 'REINFORCE steps (one context each)')
    warm_steps: int = opt(100, "imitation steps on alpha's ranking (observed attention, H2O's score) before REINFORCE "
                          "(0: none)")
    lr: float = opt(3e-4, "Adam learning rate (3e-3 degraded the warm start on validation: assets/policy/README.md)")
    entropy_coef: float = opt(1e-4, "beta, weight of the entropy bonus")
    checkpoint_every: int = opt(25, 'steps between checkpoints (each also scores the validation contexts)')
    val_contexts: int = opt(8, "held-out contexts (calib split) for the deterministic-policy KL; best.safetensors "
                            "keeps the best")
    seed: int = opt(0, 'sampling and data order')
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # policy shape and scope (flags flattened)


@dataclass
class Sample:
    """A cached training context."""

    obs: Observed  # prefill features and full keys/values
    cont: Tensor  # (1, q + n) the tail teacher-forced after the context: q unscored "question" tokens, then n scored
    ref: Tensor  # (n, V) full-cache logits over the tail's last n positions, the ones the reward and validation score


def compressed(obs: Observed, per_layer: Tensor) -> Tensor:
    """``per_layer`` (layers first) restricted to the layers eviction compresses (all but ``obs.window_layers``);
    the tensor itself without window layers."""
    if not obs.window_layers:
        return per_layer
    keep = [layer for layer in range(per_layer.shape[0]) if layer not in obs.window_layers]
    return per_layer[torch.tensor(keep, device=per_layer.device)]


def rows(policy: Policy, obs: Observed) -> Tensor:
    """Policy scores as rows: per-head (L*Hkv, T), L the full-attention layers, or global (1, T)."""
    if policy.config.per_head:
        return policy(compressed(obs, obs.head_features)[:, 0]).flatten(0, 1)
    return policy(obs.global_features)


def indices_from_rows(idx: Tensor, obs: Observed, per_head: bool) -> list[Tensor | None] | Tensor:
    """Kept indices in ``prune``'s layout from rows (R, B): per head, the rows of every layer or of the
    full-attention layers alone (``rows``); a sliding-window layer's entry is None (kept whole)."""
    idx = idx.sort(-1).values
    if not per_head:
        return idx
    n_layers, n_kv = obs.head_features.shape[0], obs.head_features.shape[2]
    given = idx.shape[0] // n_kv
    per_layer = list(idx.view(given, 1, n_kv, -1).unbind(0))
    if given == n_layers:
        return [None if layer in obs.window_layers else i for layer, i in enumerate(per_layer)]
    it = iter(per_layer)  # the full-attention layers' rows, in order
    return [None if layer in obs.window_layers else next(it) for layer in range(n_layers)]


def rollout_kl(model, sample: Sample, indices) -> float:
    """Mean KL(full || pruned) over the sample's scored continuation."""
    cache = prune(model, sample.obs, indices)
    logits = hf.continue_logits(model, cache, sample.cont, sample.obs.n_tokens)[0]
    return float(scored_kl(sample, logits).mean())


def scored_kl(sample: Sample, logits: Tensor) -> Tensor:
    """Per-step KL(full || pruned) on the scored positions: the last len(sample.ref) of the tail's ``logits``."""
    return metrics.kl_per_token(sample.ref, logits[-sample.ref.shape[0]:])


def prepare(model, tokenizer, cfg: TrainConfig, split: str, count: int, progress: bool | Reporter = True,
            hidden: bool = False, windows: list[list[int]] | None = None) -> list[Sample]:
    """Prefill ``count`` contexts of one split of each corpus, once (``hidden``: keeping every layer's
    normalised input, ``Observed.hidden``; ``windows``: these token windows instead of the first ones of
    each corpus)."""
    from scdviz import data

    sources = (["texts"] if cfg.texts else []) + list(cfg.corpora)  # "texts": the user's text
    if not sources:
        raise ValueError("no text to train on: give --texts or at least one of --corpora")
    per = -(-count // len(sources))
    length = cfg.context_len + cfg.question_len + cfg.cont_len
    windows = windows or [w for c in sources
                          for w in data.token_windows(tokenizer, data.passages(c, split, cfg.texts), length, per,
                                                      cfg.spread)]
    if len(windows) < count:
        raise ValueError(f"only {len(windows)} {split} windows of {length} tokens in {', '.join(sources)}")
    out = []
    for w in steps(windows[:count], f"prefill {split} contexts", progress):
        ids = hf.ids_tensor(w)
        cont = ids[:, cfg.context_len :]
        with hf.eager(model):  # features need attention probabilities; restored for other users
            obs = observe(model, ids[:, : cfg.context_len], cfg.policy.window,
                          lookahead=(cfg.policy.lookahead, cfg.policy.lookahead_samples), seed=cfg.seed,
                          hidden=hidden)
            full = hf.make_cache(model, obs.keys, obs.values)
            positions = torch.arange(cfg.context_len, cfg.context_len + cont.shape[1]).unsqueeze(0)
            trace = hf.forward(model, cont, cache=full, positions=positions)
        out.append(Sample(obs, cont, trace.logits[0, -cfg.cont_len:]))
    return out


def warm_start(policy: Policy, samples: list[Sample], cfg: TrainConfig, opt: torch.optim.Optimizer, log: dict,
               progress: bool | Reporter = True) -> None:
    """Imitate alpha's ranking (H2O's score): maximise its Plackett-Luce likelihood, at ``cfg.lr`` as REINFORCE."""
    for group in opt.param_groups:
        group["lr"] = cfg.lr
    _imitate(policy, samples, cfg, opt, log, progress)


def _imitate(policy: Policy, samples: list[Sample], cfg: TrainConfig, opt: torch.optim.Optimizer, log: dict,
             progress: bool | Reporter) -> None:
    for step in steps(range(cfg.warm_steps), "warm start (alpha)", progress):
        sample = samples[step % len(samples)]
        scores = rows(policy, sample.obs)
        heuristic = rows_of_feature(sample.obs, policy.config.per_head, 0)
        n_keep = keep_count(sample.obs.n_tokens, cfg.keeps[step % len(cfg.keeps)])
        target = heuristic.topk(n_keep, dim=-1).indices
        loss = -plackett_luce_logprob(scores, target).mean() / n_keep
        opt.zero_grad()
        loss.backward()
        opt.step()
        log["warm"].append(round(float(loss.detach()), 5))


def rows_of_feature(obs: Observed, per_head: bool, idx: int) -> Tensor:
    """One raw feature as rows, laid out like ``rows``."""
    if per_head:
        return compressed(obs, obs.head_features)[:, 0, ..., idx].flatten(0, 1)
    return obs.global_features[..., idx]


def held_kl(model, sample: Sample, indices, evictor) -> Tensor:
    """Per-step KL(full || pruned) over the sample's scored continuation, its tail decoded one token at
    a time from the cache pruned to ``indices``, with ``evictor`` (a DecodeEvictor) holding it at its budget."""
    with hf.eager(model), evictor(model):
        logits = hf.continue_logits(model, prune(model, sample.obs, indices), sample.cont, sample.obs.n_tokens,
                                    one_at_a_time=True)[0]
    return scored_kl(sample, logits)


def reinforce_step(model, policy, sample: Sample, n_keep: int, cfg: TrainConfig, gen) -> dict:
    """Sample M subsets for one context and return the loss and its statistics."""
    scores = rows(policy, sample.obs)
    rankings = torch.stack([gumbel_top_b(scores, n_keep, gen) for _ in range(cfg.samples)])  # (M, R, B)
    kls = [rollout_kl(model, sample, indices_from_rows(r, sample.obs, policy.config.per_head)) for r in rankings]
    rewards = -torch.tensor(kls, device=scores.device)
    loss, entropy = reinforce_loss(scores, rankings, rewards, cfg.entropy_coef)
    return {"loss": loss, "kl": sum(kls) / len(kls), "entropy": float(entropy)}


def subject(pair) -> tuple:
    """(model, tokenizer, source) of what a policy is trained or benched on: a ``Pair``'s producer (the
    model whose caches are pruned), or a (model, tokenizer, source) triple for a model loaded alone."""
    if isinstance(pair, tuple):
        return pair
    return pair.producer, pair.tokenizer, pair.producer_source


@dataclass
class Checkpoint:
    """A training run's state at a checkpoint: what a caller saves, and what a resumed run starts from."""

    policy: Policy  # the current policy (meta: steps)
    optimizer: dict  # its Adam state (state_dict)
    log: dict  # the training log so far
    best: Policy | None = None  # the checkpoint with the lowest validation KL so far (meta: steps, val_kl)


@dataclass
class Event:
    """What ``train`` tells its callback: after every REINFORCE step (``kind`` "step") and after
    every validation (``kind`` "checkpoint", with the state to save)."""

    kind: str  # "step" or "checkpoint"
    step: int  # REINFORCE steps done
    log: dict  # the training log so far (one dict, growing)
    val_kl: float | None = None  # checkpoint: the validation KL just measured
    improved: bool = False  # checkpoint: the current policy is the best so far (``checkpoint.best`` is it)
    checkpoint: Checkpoint | None = None  # checkpoint: the state to save; resume with train(..., state=...)


def train(cfg: TrainConfig, pair, callback=None, *, state: Checkpoint | None = None,
          progress: bool | Reporter = True) -> Policy:
    """Train a policy (``fit``): returns the checkpoint chosen on validation (lowest validation KL),
    with the run's log as ``policy.log``. Writes no file.

    pair: a ``Pair`` (its producer is trained on) or a (model, tokenizer, source) triple
    (``subject``); the model is only read, so it may be shared. callback(Event): after every
    step and every checkpoint (validation), e.g. ``checkpoints_to(folder)``, which writes the run
    folder. state: a ``Checkpoint`` to resume from (``load_checkpoint``); its policy must have been
    trained on this model with this policy config.
    """
    model, tokenizer, source = subject(pair)
    windows.compressed_layers(model)  # a model of sliding-window layers only has nothing to compress: refused
    if cfg.samples < 2:
        raise ValueError(f"--samples must be at least 2 (the leave-one-out baseline), got {cfg.samples}")
    device = hf.device_of(model)
    torch.manual_seed(cfg.seed)
    policy = Policy(cfg.policy).to(device)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    log = {"config": asdict(cfg), "model": source, "warm": [], "steps": [], "val": [], "seconds": 0.0}
    policy.identity = {"model_source": source, "model_fingerprint": artefact.fingerprint(model)}
    best = None
    if state is not None:
        policy, log, best = _resume(state, cfg, model, source, device)
        opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
        opt.load_state_dict(state.optimizer)
    log["started"] = time.time() - log["seconds"]
    samples = prepare(model, tokenizer, cfg, "train", cfg.contexts, progress)
    held_out = prepare(model, tokenizer, cfg, "calib", cfg.val_contexts, progress)
    _heuristic_lines(model, cfg, held_out, log)
    run = _Run(model, policy, opt, log, held_out, cfg, callback, best)
    if not log["val"]:  # a fresh run: the starting point (after any warm start) is the first checkpoint
        if cfg.warm_steps:
            warm_start(policy, samples, cfg, opt, log, progress)
        run.checkpoint()
    order = random.Random(cfg.seed + len(log["steps"]))
    gen = torch.Generator(device=device).manual_seed(cfg.seed + len(log["steps"]))
    bar = steps(range(len(log["steps"]), cfg.steps), "reinforce", progress)
    for step in bar:
        sample = samples[order.randrange(len(samples))]
        keep = cfg.keeps[step % len(cfg.keeps)]
        stats = reinforce_step(model, policy, sample, keep_count(sample.obs.n_tokens, keep), cfg, gen)
        opt.zero_grad()
        stats.pop("loss").backward()
        opt.step()
        log["steps"].append(
            {
                "step": step,
                "keep": keep,
                "reward": round(-stats["kl"], 5),
                "kl": round(stats["kl"], 5),
                "entropy": round(stats["entropy"], 4),
            }
        )
        if hasattr(bar, "set_postfix"):  # a tqdm bar (the CLI)
            bar.set_postfix(kl=f"{stats['kl']:.4f}", keep=keep)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            run.checkpoint()
        if callback is not None:
            callback(Event("step", len(log["steps"]), log))
    chosen = copy.deepcopy(run.best if run.best is not None else policy).eval()
    chosen.log = log
    return chosen


def _resume(state: Checkpoint, cfg: TrainConfig, model, source: str, device) -> tuple[Policy, dict, Policy | None]:
    """The policy (on ``device``, training mode), log and best checkpoint of ``state``; ValueError when it
    belongs to another model or policy config."""
    policy = state.policy.to(device).train()
    if policy.config != cfg.policy:
        raise ValueError(f"checkpoint policy config {policy.config} differs from the requested {cfg.policy}")
    if policy.identity.get("model_fingerprint") != artefact.fingerprint(model):
        raise ValueError(f"the run trained on {policy.identity.get('model_source')!r}, not on {source!r}")
    return policy, state.log, state.best


def _heuristic_lines(model, cfg: TrainConfig, held_out: list[Sample], log: dict) -> None:
    """The heuristic's validation KL, logged once per run: alpha (H2O's score) at prefill."""
    if "val_heuristic" not in log:
        log["val_heuristic"] = round(
            validate(model, lambda s: rows_of_feature(s.obs, cfg.policy.per_head, 0), cfg.policy.per_head, held_out,
                     cfg.keeps), 5)


@dataclass
class _Run:
    """One training run's checkpointing: validate, keep the best, tell the callback."""

    model: object
    policy: Policy
    opt: torch.optim.Optimizer
    log: dict
    held_out: list[Sample]
    cfg: TrainConfig
    callback: object
    best: Policy | None

    def checkpoint(self) -> None:
        """Validate the current policy, keep it when it is the best so far, and hand the state to the callback."""
        cfg, policy, log = self.cfg, self.policy, self.log
        val = round(validate(self.model, lambda s: rows(policy, s.obs), policy.config.per_head, self.held_out,
                             cfg.keeps), 5)
        log["val"].append({"step": len(log["steps"]), "kl": val})
        # compared as logged (an unrounded value could miss its own entry)
        improved = val <= min(v["kl"] for v in log["val"])
        if improved:
            self.best = copy.deepcopy(policy).eval()
            self.best.meta = {"steps": len(log["steps"]), "val_kl": val}
        log["seconds"] = round(time.time() - log["started"], 1)
        policy.meta = {"steps": len(log["steps"])}
        if self.callback is not None:
            state = Checkpoint(policy, self.opt.state_dict(), log, self.best)
            self.callback(Event("checkpoint", len(log["steps"]), log, val, improved, state))


# ----------------------------------------------------------------------------- the run folder (callers write it)

POLICY_FILE, OPTIMIZER_FILE = "policy.safetensors", "optimizer.pt"  # the last checkpoint, to resume from
BEST_FILE, LOG_FILE = POLICY_FOLDER_FILE, POLICY_LOG  # the policy chosen on validation, and the log


def run_folder(cfg: TrainConfig, resume: bool) -> Path:
    """The run folder ``cfg.out``, made; ValueError when there is nothing to resume in it."""
    out = Path(cfg.out)
    if resume and not (out / POLICY_FILE).is_file():
        raise ValueError(f"nothing to resume in {out} (no {POLICY_FILE})")
    out.mkdir(parents=True, exist_ok=True)
    return out


def save_checkpoint(folder: str | Path, state: Checkpoint, improved: bool) -> None:
    """Write a checkpoint into a run folder: policy.safetensors (the current policy), optimizer.pt,
    log.json and, when ``improved``, best.safetensors (the best so far). The shipped layout."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if improved and state.best is not None:
        state.best.save(folder / BEST_FILE, meta=state.best.meta)
    state.policy.save(folder / POLICY_FILE, meta=state.policy.meta)
    torch.save(state.optimizer, folder / OPTIMIZER_FILE)
    (folder / LOG_FILE).write_text(json.dumps(state.log, indent=1))


def checkpoints_to(folder: str | Path, then=None):
    """A ``train`` callback writing every checkpoint into ``folder`` (``save_checkpoint``) and passing
    every event on to ``then`` (e.g. a live plot)."""
    def callback(event: Event) -> None:
        if event.kind == "checkpoint":
            save_checkpoint(folder, event.checkpoint, event.improved)
        if then is not None:
            then(event)

    return callback


def load_checkpoint(folder: str | Path, device=hf.HOST) -> Checkpoint:
    """A run folder's last checkpoint, to resume from (``train(..., state=...)``)."""
    folder = Path(folder)
    policy = Policy.load(folder / POLICY_FILE)
    best = Policy.load(folder / BEST_FILE) if (folder / BEST_FILE).is_file() else None
    optimizer = torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location=device)  # tensors only
    return Checkpoint(policy, optimizer, json.loads((folder / LOG_FILE).read_text()), best)


def validate(model, scorer, per_head: bool, samples: list[Sample], keeps: tuple[float, ...]) -> float:
    """Mean KL of deterministic top-B of ``scorer(sample) -> rows`` over samples and kept fractions
    (``validation_kls``, averaged)."""
    kls = validation_kls(model, scorer, per_head, samples, keeps)
    return sum(kls) / len(kls)


def validation_kls(model, scorer, per_head: bool, samples: list[Sample], keeps: tuple[float, ...]) -> list[float]:
    """KL of deterministic top-B of ``scorer(sample) -> rows``, one per sample and kept fraction
    (sample-major), for paired comparisons."""
    kls = []
    with torch.no_grad():
        for sample in samples:
            scores = scorer(sample)
            for keep in keeps:
                n_keep = keep_count(sample.obs.n_tokens, keep)
                idx = indices_from_rows(scores.topk(n_keep, dim=-1).indices, sample.obs, per_head)
                kls.append(rollout_kl(model, sample, idx))
    return kls
