"""The distilled scorer (``Student``): a linear scorer on what each layer computes anyway, distilled from the future.

The headline eviction method. Not DistillCache as docs/design.md specifies it (an MLP over five attention
features trained by REINFORCE: scdviz.evict.policy / train): a KVzap-style scorer fitted to the attention the
text after each context pays its tokens, with no reinforcement learning. The class keeps its historical name,
``Student`` (it was first fitted as DistillCache's student); every table, the app and the README call it the
distilled scorer.

Per layer and KV head (or, ``per_head=False``, one row per layer that every head shares, for
paged-KV servers whose pages span heads) a token's score is ``w . x`` with

    x = [H_in (the layer's normalised input, d), log ||v|| (the token's value in that head),
         log(1 + pos), log(n - pos), (log window attention), 1]

where pos is the token's position and n the number of positions the layer has seen when it
scores (n - pos: the token's age + 1). This is KVzap's shape (kvpress: a linear model on the
hidden state, trained by regression on oracle log-scores) with three cheap columns added. It
reads no attention probabilities, so it runs with SDPA attention at prefill, and while decoding
(``DecodeEvictor``) it scores each token once, when the token arrives (``static``: every column
but the age), and adds the age term when it cuts (``age``). Cost per token per layer:
``flops_per_token`` (~3.5 kFLOP on SmolLM2-135M, 0.05% of a layer's ~7 MFLOP).

With ``StudentConfig.window`` W > 0 it has one more column, before the intercept: log of the
attention the last W queries pay each token (SnapKV's observation window; summed over the W rows
/ W, averaged over each KV head's query heads; ``window_column``). At a prefill the press computes
those W rows (``hf.window_rows``: W query projections and W x T scores per layer, the probabilities
that SDPA does not return); while decoding they are the model's own attention rows of the last W
decode steps (eager or ``hf.ROWS`` attention), buffered by ``DecodeEvictor``, so the column changes
at every cut like the age term (``dynamic``).

It is fitted by ``scdviz.evict.student_fit`` (closed-form distillation from the future's
attention, then a listwise stage) and is one scdviz artefact (``save`` / ``load``) with its fit log
beside it, laid out as a policy folder (``best.safetensors`` + ``log.json``) so the benches read
both alike.

``StudentPress`` is the student as a kvpress ``ScorerPress`` (prefill compression; any
attention implementation); like every press here it leaves sliding-window layers whole and refuses a model
whose every layer is sliding (``scdviz.evict.windows``), and a student fitted for other shapes is refused by
``Student.check_model`` in one line naming both. This module does not fit (student_fit.py), evict while decoding
(decode.py holds the arrival scores) nor benchmark (bench.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvpress import ScorerPress
from torch import Tensor, nn

from scdviz import artefact, config
from scdviz.config import opt
from scdviz.evict import windows
from scdviz.evict.policy import FILE, LOG, SHIPPED_DIR, compression_ratio, keep_count
from scdviz.models import hf

KIND = "distillcache-student"
N_EXTRA = 4  # columns after H_in without a window: log ||v||, log(1 + pos), log(n - pos), 1
WINDOW_EPS = 1e-6  # added to the window column before its log (a token no window row saw)
SHIPPED = SHIPPED_DIR / "student_window"  # the shipped distilled scorer (per head, window 32): the headline
SINK_BONUS = 1e4  # added to the scores of the first StudentConfig.sinks positions: above any fitted score
CLOSED_FORM = "closed_form.safetensors"  # beside a student's best.safetensors: its closed form (before listwise)


@dataclass
class StudentConfig:
    """Shape of a student."""

    per_head: bool = opt(True, "True: a score (and kept set) per layer and KV head; False: one per layer, shared by "
                         "its heads (paged KV, whose pages span heads)")
    ridge: float = opt(10.0, "ridge strength, relative to 1e-3 x the mean diagonal of the normal equations (fit "
                       "chooses it from FitConfig.ridges on validation)")
    sinks: int = opt(0, "the first this-many positions always kept (a bonus of SINK_BONUS to their scores), as "
                     "kvpress's KVzip protects 4 attention sinks; the KVzap-style fit needs it (KVzip+ weighs a "
                     "token by ||W_o v||, small for the sink, so its target evicts it); 0: none, the score decides")
    window: int = opt(0, "W > 0: one more column, log of the attention the last W queries pay each token (SnapKV's "
                      "observation window; computed at prefill from W query projections, read from the model's "
                      "attention rows of the last W steps while decoding); 0: no attention input")

    def n_extra(self) -> int:
        """Columns after H_in: log ||v||, log(1 + pos), log(n - pos), [log window attention,] 1."""
        return N_EXTRA + (self.window > 0)


def window_column(rows: Tensor, n_kv: int) -> Tensor:
    """(B, Hkv, T) the window column's attention before its log: rows (B, H, W, T) of W queries, summed / W,
    averaged over each KV head's query heads."""
    b, h, w, t = rows.shape
    return (rows.float().sum(2) / max(w, 1)).view(b, n_kv, h // n_kv, t).mean(2)


class Student(nn.Module):
    """Per-layer linear scorer: weight (L, R, d + 4 (+ 1 with a window)), R = Hkv (per head) or 1 (per layer)."""

    def __init__(self, n_layers: int, n_kv: int, hidden: int, config: StudentConfig | None = None):
        super().__init__()
        self.config = config or StudentConfig()
        self.n_kv, self.hidden = n_kv, hidden
        rows = n_kv if self.config.per_head else 1
        self.weight = nn.Parameter(torch.zeros(n_layers, rows, hidden + self.config.n_extra()))
        self.identity: dict = {}  # the model it was fitted on (source, weight fingerprint)
        self.meta: dict = {}  # what its fit recorded
        self.log: dict | None = None  # its fit log (log.json beside its file), when known
        self.stages: dict[str, Student] = {}  # after a fit: "closed_form", its closed form before the listwise stage

    @classmethod
    def for_model(cls, model, config: StudentConfig | None = None) -> Student:
        """A zero student shaped for ``model``."""
        _, n_kv, _ = hf.attn_heads(model)
        return cls(hf.n_layers(model), n_kv, model.config.hidden_size, config)

    def flops_per_token(self, head_dim: int, n_heads: int, context: int = 512) -> int:
        """FLOPs per token per layer (2 per multiply-add): every row's dot product and the value norms
        (``head_dim`` values per KV head); the logs are not counted. With a window, at a prefill of ``context``
        tokens: the W rows' scores over each token (2 W H D) and the W query projections (2 W d H D), shared by
        the ``context`` tokens (``n_heads``: query heads H)."""
        out = 2 * self.weight.shape[1] * self.weight.shape[-1] + 2 * self.n_kv * head_dim
        w = self.config.window
        if w:
            out += 2 * w * n_heads * head_dim + -(-2 * w * self.hidden * n_heads * head_dim // max(context, 1))
        return out

    def log_norm(self, values: Tensor) -> Tensor:
        """(B, R, T) log ||v|| per head, or its mean over heads for a per-layer student."""
        logv = values.float().norm(dim=-1).clamp_min(1e-6).log()
        return logv if self.config.per_head else logv.mean(1, keepdim=True)

    def static(self, layer: int, hidden: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        """(B, R, T) the part of the score fixed when a token arrives: hidden (B, T, d), values (B, Hkv, T, D),
        positions (T,) or (B, R, T) of those tokens."""
        w = self.weight[layer].to(hidden.device)  # (R, F)
        d = self.hidden
        pos = positions.to(hidden.device).float()
        out = (hidden.float() @ w[:, :d].T).transpose(1, 2)  # (B, R, T)
        out = out + w[:, d, None] * self.log_norm(values) + w[:, d + 1, None] * pos.log1p() + w[:, -1, None]
        return out + SINK_BONUS * (pos < self.config.sinks) if self.config.sinks else out

    def age(self, layer: int, positions: Tensor, now: int) -> Tensor:
        """(..., R, T) the part that changes as the layer grows: w_age x log(now - pos), ``now`` the positions
        seen so far (the newest token's position + 1)."""
        w = self.weight[layer, :, self.hidden + 2].to(positions.device)
        return w[:, None] * (now - positions.float()).clamp_min(1.0).log()

    def window_term(self, layer: int, column: Tensor) -> Tensor:
        """(B, R, T) w_window x log(column + WINDOW_EPS): column (B, Hkv, T) from ``window_column`` (its mean over
        heads for a per-layer student)."""
        column = column.float() if self.config.per_head else column.float().mean(1, keepdim=True)
        w = self.weight[layer, :, self.hidden + 3].to(column.device)
        return w[:, None] * (column + WINDOW_EPS).log()

    def dynamic(self, layer: int, positions: Tensor, now: int, column: Tensor | None) -> Tensor:
        """(B, R, T) the part of the score that changes after a token arrives: the age term, plus the window term
        when the student has one (``column``: (B, Hkv, T) the window's attention to the same tokens)."""
        out = self.age(layer, positions, now)
        if self.config.window:
            if column is None:
                raise ValueError(f"this student reads the attention of the last {self.config.window} queries: give "
                                 "their window column (window_column)")
            out = out + self.window_term(layer, column)
        return out

    def forward(self, layer: int, hidden: Tensor, values: Tensor, positions: Tensor | None = None,
                now: int | None = None, column: Tensor | None = None) -> Tensor:
        """Scores (B, Hkv, T) of one layer's tokens (a per-layer student's row repeated over heads); positions
        default to 0..T-1 and ``now`` to T (a prefill); ``column`` (B, Hkv, T): the window's attention, needed
        when the student has a window."""
        t = hidden.shape[1]
        positions = torch.arange(t, device=hidden.device) if positions is None else positions
        out = self.static(layer, hidden, values, positions) + self.dynamic(layer, positions.to(hidden.device),
                                                                            t if now is None else now, column)
        return out.expand(-1, self.n_kv, -1)

    def save(self, path: str | Path, identity: dict | None = None, meta: dict | None = None) -> Path:
        """Write the student (scdviz.artefact): a ``.safetensors`` file, or a folder (its ``best.safetensors``,
        ``closed_form.safetensors`` when the listwise stage moved it from its closed form, and, with a fit log,
        ``log.json`` beside them). Returns what was written."""
        path = Path(path)
        if path.suffix == ".safetensors":
            cfg = config.to_dict(self.config) | {"n_kv": self.n_kv, "hidden": self.hidden}
            return artefact.save(path, KIND, {"weight": self.weight.detach()}, identity or self.identity, cfg,
                                 self.meta if meta is None else meta)
        self.save(path / FILE, identity, meta)
        closed = self.stages.get("closed_form")
        if closed is not None and closed is not self:  # the closed form, beside it
            closed.save(path / CLOSED_FORM, identity)
        if self.log is not None:
            (path / LOG).write_text(json.dumps(self.log, indent=1))
        return path

    @classmethod
    def shipped(cls) -> Student:
        """The shipped distilled scorer (``assets/policy/student_window``): the headline eviction method, fitted on the
        built-in producer (its recipe is in its fit log, ``log.json`` beside it)."""
        return cls.load(SHIPPED)

    @classmethod
    def load(cls, path: str | Path) -> Student:
        """Read a student written by ``save`` (a file, or a folder's ``best.safetensors``), on the host."""
        path = Path(path)
        if path.suffix != ".safetensors" and not path.is_file():
            path = path / FILE
        art = artefact.load(path, KIND)
        shape = {k: art.config.pop(k, None) for k in ("n_kv", "hidden")}
        cfg, _ = config.from_dict(StudentConfig, art.config, str(path))
        weight = art.tensors.get("weight")
        if weight is None or weight.dim() != 3 or None in shape.values() or \
                weight.shape[-1] != shape["hidden"] + cfg.n_extra() or weight.shape[1] != (shape["n_kv"] if cfg.per_head
                                                                                     else 1):
            raise ValueError(f"{path}: weights do not fit its config")
        student = cls(weight.shape[0], shape["n_kv"], shape["hidden"], cfg)
        with torch.no_grad():
            student.weight.copy_(weight)
        student.identity, student.meta = art.identity, art.meta
        log = path.with_name(LOG)
        student.log = json.loads(log.read_text()) if log.is_file() else None
        return student.eval()

    def check_model(self, model) -> None:
        """ValueError when ``model``'s layers, KV heads or width differ from the student's."""
        _, n_kv, _ = hf.attn_heads(model)
        self.check_shapes(hf.n_layers(model), n_kv, model.config.hidden_size)

    def check_shapes(self, n_layers: int, n_kv: int, hidden: int) -> None:
        """``check_model`` for a model of ``n_layers`` layers, ``n_kv`` KV heads and width ``hidden``: a one-line
        ValueError naming both shapes when they differ from the student's."""
        have = (n_layers, n_kv, hidden)
        want = (self.weight.shape[0], self.n_kv, self.hidden)
        if have != want:
            raise ValueError(f"this student was fitted for {want[0]} layers, {want[1]} KV heads and width {want[2]}; "
                             f"the model has {have[0]}, {have[1]} and {have[2]}: fit one for it "
                             "(python -m scdviz fit-student --model ...)")


def is_student(path: str | Path) -> bool:
    """Whether a policy path (file or folder) holds a student rather than a feature policy."""
    path = Path(path)
    if path.suffix != ".safetensors" and not path.is_file():
        path = path / FILE
    try:
        return artefact.kind_of(path) == KIND
    except (OSError, ValueError):
        return False


@dataclass
class StudentPress(windows.WindowLayersKept, ScorerPress):
    """The distilled scorer as a kvpress press: ``score`` is the student's (no attention needed).

    Parameters
    ----------
    student : Student
        ``Student.load(path)`` or ``Student.shipped()``.
    compression_ratio : float
        Fraction of the context removed (kvpress convention).
    """

    student: Student | None = None
    compression_ratio: float = 0.0
    # per layer, after a prefill it compressed: (positions (B, Hkv, n) of the kept tokens in cache order, the
    # student's static scores of them (B, R, n)): what DecodeEvictor continues from (a server keeps each token's
    # score beside it); per request, like the cache it describes
    carried: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    # per layer, the arrival (static) scores (B, R, T) of the last prefill it scored, by position: what a
    # DecodeEvictor continues from after a prefill that another harness pruned (prefill_scores); per request
    arrival: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.student is None:
            raise ValueError("StudentPress needs a student (Student.load(path))")

    @classmethod
    def keeping(cls, student: Student, keep: float) -> StudentPress:
        """A press that keeps the fraction ``keep`` of the context."""
        return cls(student=student, compression_ratio=compression_ratio(keep))

    def post_init_from_model(self, model) -> None:
        super().post_init_from_model(model)  # a model of sliding-window layers only is refused
        self.student.check_model(model)

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> Tensor:
        """Scores (B, Hkv, T) of one layer's tokens, positions 0..T-1 (a prefill from an empty cache). A student
        with a window reads the last W query rows of ``attentions`` (eager) or computes them (``hf.window_rows``,
        from the layer's own queries: SDPA returns no probabilities; softcapping and windows as the layer has
        them). A student fitted for other shapes is refused (``Student.check_shapes``), also where a caller scores
        without ``post_init_from_model``."""
        student, layer = self.student, module.layer_idx
        student.check_shapes(module.config.num_hidden_layers, keys.shape[1], hidden_states.shape[-1])
        with torch.no_grad():
            t = hidden_states.shape[1]
            positions = torch.arange(t, device=hidden_states.device)
            static = student.static(layer, hidden_states, values, positions)
            column = None
            w = min(student.config.window, t)
            if w:
                if attentions is not None:
                    rows = attentions[:, :, -w:]
                else:
                    cos, sin = kwargs["position_embeddings"]
                    rows = hf.window_rows(module, hidden_states[:, -w:], keys, cos[:, -w:], sin[:, -w:])
                column = window_column(rows, keys.shape[1])
            self.arrival[layer] = static
            return (static + student.dynamic(layer, positions, t, column)).expand(-1, student.n_kv, -1)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs) -> tuple[Tensor, Tensor]:
        """kvpress's top-B pruning of one layer, remembering the kept tokens' positions and static scores
        (``carried``)."""
        layer = module.layer_idx
        if layer == windows.layers_of(module)[0]:  # the first layer it compresses: a new prefill
            self.carried.clear()
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        t = keys.shape[2]
        idx = scores.topk(keep_count(t, 1.0 - self.compression_ratio), dim=-1).indices  # (B, Hkv, n)
        rows = self.student.weight.shape[1]
        self.carried[layer] = (idx, self.arrival[layer].gather(2, idx[:, :rows]))
        full = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, full).contiguous(), values.gather(2, full).contiguous()
