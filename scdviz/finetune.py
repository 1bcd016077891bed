"""Make a LoRA specialist of the built-in producer on a shipped corpus or on your own text.

    python -m scdviz finetune --texts my.txt --name mine      # -> <runs>/specialists/mine
    python -m scdviz finetune --corpus jargon --maintainer     # -> assets/adapters/jargon

Plain next-token training on non-overlapping windows of the text's *train* split (``--task text``), or the
context-QA tasks of scdviz.qa (``--task quote`` or ``before``: each window is a context followed by a question
about it, the loss on the answer tokens only), with AdamW, linear warm-up then cosine decay, fp32 on CPU, bf16
autocast on CUDA;
the adapter (fp16 safetensors) and ``train_log.json`` (loss per step and settings) go to
``--out``. The model card numbers come from ``python -m scdviz pair-info --eval``.
What it does not do: evaluate, or fine-tune anything but LoRA adapters.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from scdviz import data, qa
from scdviz.config import opt
from scdviz.models import hf
from scdviz.models import pair as pairmod

TASKS = ("text", *qa.KINDS)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class FinetuneConfig:
    corpus: str | None = opt(None, "shipped corpus to train on (assets/text/<corpus>/train.txt.gz)")
    texts: str | None = opt(None, "your text instead (.txt / .jsonl file, or a folder of train/calib/eval files); its "
                            "train split is used, so pair-info, calibrate and bench can measure on the rest")
    out: str = opt(None, "adapter folder to write (set by the CLI: a runs folder by default)")
    base: str = opt("builtin:smollm2-135m", 'model to adapt')
    rank: int = opt(8, 'LoRA rank')
    alpha: int | None = opt(None, 'LoRA alpha (default 2 * rank)')
    steps: int = opt(60, 'optimiser steps')
    batch: int = opt(4, 'windows per step')
    seq_len: int = opt(256, 'tokens per window')
    lr: float = opt(1e-3, 'peak learning rate')
    warmup: int = opt(5, 'linear warm-up steps')
    seed: int = opt(0, 'data order and LoRA init')
    task: str = opt("text", "what it learns: text (next-token prediction on each window), or a context-QA task of "
                    "scdviz.qa, each window the context and then a question about it, the loss on the answer only: "
                    "quote (continue a quote of it) or before (the words before a quote, nearest first)",
                    choices=TASKS)
    answer_len: int = opt(qa.ANSWER_LEN, "quote / before: answer tokens per question (as the SCD bench asks)")
    text_loss: float = opt(0.0, "quote / before: also next-token loss on the window, the mean over its tokens times "
                           "this weight added to the answer's mean (the specialist stays a language model of its "
                           "text; 0: none)")
    layers: list[int] = opt([], "decoder layers whose targets get an adapter, counted from 0 (default: every layer; "
                            "early layers move the cache of every layer above them)")
    targets: list[str] = opt(list(TARGETS),
                             "linear layers that get an adapter (adapters on k_proj/v_proj move the KV cache most)",
                             choices=tuple(TARGETS))
    checkpoint_every: int = opt(50, "steps between checkpoints in <out>/checkpoint: the same command run again "
                                "resumes a stopped run from the last one (0: none); removed once the adapter is saved")


def finetune(cfg: FinetuneConfig, progress=None) -> dict:
    """Train the adapter; returns the training log (also written to out/train_log.json)."""
    from peft import LoraConfig, get_peft_model

    if bool(cfg.corpus) == bool(cfg.texts):
        raise ValueError("give either --texts (your text) or --corpus (a shipped one), not both or neither")
    if not cfg.out:
        raise ValueError("give the adapter folder to write (out)")
    if cfg.task not in TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; use one of {TASKS}")
    if cfg.task != "text" and not 1 <= cfg.answer_len <= cfg.seq_len // 3:
        raise ValueError(f"answer_len must be 1..{cfg.seq_len // 3} (a third of --seq-len), got {cfg.answer_len}")
    if not 0 <= cfg.text_loss <= 100:
        raise ValueError(f"--text-loss is a weight from 0 to 100, got {cfg.text_loss}")
    torch.manual_seed(cfg.seed)
    model, tokenizer = pairmod.load_model(cfg.base)
    model.train()
    n_layers = hf.n_layers(model)
    if any(not 0 <= i < n_layers for i in cfg.layers):
        raise ValueError(f"--layers are 0 to {n_layers - 1} on this model; got {list(cfg.layers)}")
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha or 2 * cfg.rank,
                      target_modules=hf.lora_targets(model, list(cfg.targets)),
                      layers_to_transform=sorted(set(cfg.layers)) or None, lora_dropout=0.0)
    model = get_peft_model(model, lora)
    windows = data.token_windows(tokenizer, data.passages(cfg.corpus or data.USER, "train", cfg.texts), cfg.seq_len)
    if not windows:
        raise ValueError(f"the training text has no window of {cfg.seq_len} tokens; give more text or lower --seq-len")
    random.Random(cfg.seed).shuffle(windows)
    asked = random.Random(cfg.seed + 1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * frac))

    ckpt, start, losses, before = Path(cfg.out) / "checkpoint", 0, [], 0.0
    if cfg.checkpoint_every and (ckpt / "state.json").is_file():
        start, losses, before = _resume(ckpt, cfg, params, opt, asked)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    # bf16 autocast only on CUDA: on CPUs without native bf16 it measured ~20x slower here.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    bar = tqdm(range(start, cfg.steps), desc=f"finetune {cfg.corpus or Path(cfg.texts).name}", initial=start,
               total=cfg.steps)
    for step in bar:
        idx = [(step * cfg.batch + i) % len(windows) for i in range(cfg.batch)]
        ids, labels = zip(*(example(tokenizer, windows[i], cfg, asked) for i in idx), strict=True)
        batch = torch.tensor(ids, device=device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with autocast:
            loss = batch_loss(model, batch, torch.tensor(labels, device=device),
                              cfg.seq_len if cfg.task != "text" else 0, float(cfg.text_loss))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        bar.set_postfix(loss=losses[-1], refresh=False)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            _checkpoint(ckpt, cfg, step + 1, losses, before + time.perf_counter() - t0, params, opt, asked)
        if progress:
            progress((step + 1) / cfg.steps, f"step {step + 1}/{cfg.steps} loss {losses[-1]:.3f}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    log = {
        "config": asdict(cfg),
        "train_windows_available": len(windows),
        "tokens_seen": cfg.steps * cfg.batch * len(example(tokenizer, windows[0], cfg, random.Random(0))[0]),
        "seconds": round(before + time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
        "loss": losses,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    shutil.rmtree(ckpt, ignore_errors=True)
    return log


def _settings(cfg: FinetuneConfig) -> dict:
    """What a checkpoint must share with the run resuming it (how often it is written aside)."""
    return {k: v for k, v in asdict(cfg).items() if k != "checkpoint_every"}


def _checkpoint(folder: Path, cfg, step: int, losses: list[float], seconds: float, params, opt, asked) -> None:
    """The adapter's trainable tensors, AdamW's moments and the question sampler's state after ``step`` steps
    (safetensors and JSON, no pickle), written whole before the old one is replaced."""
    from safetensors.torch import save_file

    tensors = {}
    for i, p in enumerate(params):
        state = opt.state[p]
        tensors |= {f"p{i}": p.detach().contiguous(), f"m{i}": state["exp_avg"].contiguous(),
                    f"v{i}": state["exp_avg_sq"].contiguous(), f"s{i}": torch.as_tensor(state["step"]).reshape(1)}
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    version, internal, gauss = asked.getstate()
    (tmp / "state.json").write_text(json.dumps({"settings": _settings(cfg), "step": step, "losses": losses,
                                                "seconds": seconds, "asked": [version, list(internal), gauss]}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def _resume(folder: Path, cfg, params, opt, asked) -> tuple[int, list[float], float]:
    """Load a checkpoint into the run: (its step, its losses, its seconds). ValueError for other settings."""
    from safetensors.torch import load_file

    state = json.loads((folder / "state.json").read_text())
    if state["settings"] != json.loads(json.dumps(_settings(cfg))):
        raise ValueError(f"{folder} holds a checkpoint of a run with other settings: remove it, or give another "
                         "--out / --name")
    tensors = load_file(str(folder / "state.safetensors"))
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(tensors[f"p{i}"].to(p.device))
            opt.state[p] = {"step": tensors[f"s{i}"].reshape(()), "exp_avg": tensors[f"m{i}"].to(p.device),
                            "exp_avg_sq": tensors[f"v{i}"].to(p.device)}  # AdamW keeps its step count on the CPU
    version, internal, gauss = state["asked"]
    asked.setstate((version, tuple(internal), gauss))
    return state["step"], state["losses"], state["seconds"]


def batch_loss(model, batch: torch.Tensor, labels: torch.Tensor, text_len: int = 0,
               text_weight: float = 1.0) -> torch.Tensor:
    """The mean next-token loss over ``labels`` (-100: none); with ``text_len`` > 0 and ``text_weight`` > 0, plus
    text_weight times the mean over the first text_len tokens of each sequence (the window before a task's question),
    each mean taken on its own."""
    if not text_len or not text_weight:
        return model(input_ids=batch, labels=labels).loss
    logits = model(input_ids=batch).logits[:, :-1].float().flatten(0, 1)
    text = torch.full_like(batch, -100)
    text[:, :text_len] = batch[:, :text_len]
    answer, window = (torch.nn.functional.cross_entropy(logits, y[:, 1:].flatten(), ignore_index=-100)
                      for y in (labels, text))
    return answer + text_weight * window


def example(tokenizer, window: list[int], cfg: FinetuneConfig, rng: random.Random) -> tuple[list[int], list[int]]:
    """One training sequence and its labels (-100: no loss). text: the window, every token a target. quote / before:
    the window, then the question ``qa.make_item`` asks about it at a random position (the benches' format),
    labelled on the answer tokens only."""
    if cfg.task == "text":
        return list(window), list(window)
    item = qa.make_item(tokenizer, window, rng.randrange(len(window)), cfg.answer_len, kind=cfg.task)
    ids = list(window) + item.question + item.answer
    return ids, [-100] * (len(ids) - len(item.answer)) + list(item.answer)
