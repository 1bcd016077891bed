"""Does a SnapKV-style observation window make the student beat H2O at prefill? (validation only)

The student (scdviz.evict.student) reads no attention: a linear map of H_in, log ||v||, log(1 + pos),
log(n - pos). SnapKV reads the attention the last W prompt queries pay (cheap: W query rows, not
T). This probe fits, on the same spread train contexts and future-attention teacher as
``fit-student --decode-len 0``, students whose design adds log of that window attention (per KV
head: the group's query heads averaged, the W rows summed / W) for several W, and H2O's own score
(every query row: not cheap) as a reference of what attention history can add; then scores each on
the fit's validation contexts (calib split) at 25 % and 12.5 % kept against H2O's top-B.

    SCDVIZ_THREADS=2 python -m research.student_window [--contexts 120] [--windows 16 32 64]

Prints every (design, ridge)'s validation KL, its ratio to H2O's and the paired-bootstrap interval
over contexts. Calib text only: for choices.
"""

from __future__ import annotations

import argparse
import time

import torch

EPS = 1e-6


def window_attention(attn, window: int, n_kv: int):
    """(Hkv, T) the attention the last ``window`` query rows of a causal prefill (1, H, T, T) pay, summed / window,
    averaged over each KV head's query heads."""
    a = attn[0, :, -window:, :].float().sum(1) / window  # (H, T)
    return a.view(n_kv, -1, a.shape[-1]).mean(1)


def columns(extra, cols):
    """extra (R, T, 4) [log v, log1p pos, log age, 1] with ``cols`` (list of (Hkv or 1, T)) inserted before the 1."""
    rows, t = extra.shape[:2]
    added = [c.log() if c.shape[0] == rows else c.mean(0, keepdim=True).log() for c in cols]
    added = [c.expand(rows, t).unsqueeze(-1) for c in added]
    return torch.cat([extra[..., :3], *added, extra[..., 3:]], -1)


def main(argv: list[str] | None = None) -> None:
    from scdviz import metrics
    from scdviz.evict import features as F
    from scdviz.evict import student_fit as sf
    from scdviz.evict import train as trainer
    from scdviz.evict.student import Student
    from scdviz.models import hf
    from scdviz.models.pair import choose_threads, load_model
    from scdviz.progress import steps

    parser = argparse.ArgumentParser(prog="python -m research.student_window", description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=120)
    parser.add_argument("--val-contexts", type=int, default=24)
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--ridges", type=float, nargs="+", default=[1.0, 10.0, 100.0])
    args = parser.parse_args(argv)
    choose_threads()
    t0 = time.perf_counter()
    model, tokenizer = load_model("builtin:smollm2-135m")
    cfg = sf.FitConfig(contexts=args.contexts, val_contexts=args.val_contexts, decode_len=0)
    base = Student.for_model(model, cfg.student)
    n_layers, rows, f = base.weight.shape
    _, n_kv, _ = hf.attn_heads(model)
    t = cfg.context_len
    designs = {"student": [], **{f"student + window {w}": [w] for w in args.windows},
               "student + H2O's score (all rows)": [t]}
    normal = {name: sf.NormalEquations.zeros(n_layers, rows, f + len(ws)) for name, ws in designs.items()}
    positions = torch.arange(t)

    def window_cols(attn_layers, ws):
        out = []
        for layer, a in enumerate(attn_layers):
            cols = []
            for w in ws:
                if w >= t:  # H2O: alpha over every row, each token's sum over the rows that see it
                    cols.append(F.prefill_layer_features(a, torch.ones(1, n_kv, t, 1), t, n_kv)[0, ..., 0])
                else:
                    cols.append(window_attention(a, w, n_kv))
            out.append([c + EPS for c in cols])
            del layer
        return out

    all_ws = sorted({w for ws in designs.values() for w in ws})
    for window in steps(sf.windows(tokenizer, cfg, "train", cfg.contexts, t + cfg.teacher_len), "train contexts",
                        True):
        ids = hf.ids_tensor(window)
        with torch.no_grad(), hf.eager(model):
            trace = hf.forward(model, ids[:, :t], capture={"h_in"}, attentions=True, last_logits=True)
            cont = hf.forward(model, ids[:, t:], cache=hf.make_cache(model, trace.keys, trace.values),
                              attentions=True, last_logits=True)
        future = F.future_attention(cont.attn, t, n_kv)[0][:, 0]
        wcols = window_cols(trace.attn, all_ws)
        for layer in range(n_layers):
            h, extra = sf.design_parts(base, trace.h_in[layer][0], trace.values[layer][0], positions, t)
            y = sf.teacher_rows(future[layer], True)
            for name, ws in designs.items():
                normal[name].add(layer, h, columns(extra, [wcols[layer][all_ws.index(w)] for w in ws]), y)
    print(f"fitted on {cfg.contexts} train contexts in {time.perf_counter() - t0:.0f} s", flush=True)

    val = sf.prepared_samples(model, tokenizer, cfg, "calib", cfg.val_contexts, True)
    val_windows = sf.windows(tokenizer, cfg, "calib", cfg.val_contexts, t + cfg.question_len + cfg.cont_len)
    val_cols = {}
    for i, window in enumerate(val_windows):
        with torch.no_grad(), hf.eager(model):
            trace = hf.forward(model, hf.ids_tensor(window)[:, :t], attentions=True, last_logits=True)
        val_cols[id(val[i])] = window_cols(trace.attn, all_ws)

    def scorer(weight, ws):
        def score(sample):
            out = []
            for layer, (h, v) in enumerate(zip(sample.obs.hidden, sample.obs.values, strict=True)):
                hh, extra = sf.design_parts(base, h[0], v[0], positions, t)
                x = columns(extra, [val_cols[id(sample)][layer][all_ws.index(w)] for w in ws])
                out.append(hh.float() @ weight[layer, :, : hh.shape[1]].T + (x * weight[layer, :, None,
                                                                                        hh.shape[1]:]).sum(-1).T)
            return torch.cat([o.T for o in out], 0)
        return score

    h2o = trainer.validation_kls(model, lambda s: trainer.rows_of_feature(s.obs, True, 0), True, val, cfg.keeps)
    k = len(cfg.keeps)
    print(f"{cfg.val_contexts} calib contexts; H2O: {sum(h2o) / len(h2o):.5f} "
          + " / ".join(f"{sum(h2o[i::k]) / len(h2o[i::k]):.5f}" for i in range(k)) + f" at keeps {cfg.keeps}")
    print(f"{'design':36} {'ridge':>6} {'KL':>8} {'by keep':>18} {'x H2O':>6} [95% CI]")
    for name, ws in designs.items():
        for ridge in args.ridges:
            weight = normal[name].solve(ridge)
            kls = trainer.validation_kls(model, scorer(weight, ws), True, val, cfg.keeps)
            boot = metrics.paired_bootstrap(h2o, kls)
            by = " / ".join(f"{sum(kls[i::k]) / len(kls[i::k]):.4f}" for i in range(k))
            print(f"{name:36} {ridge:6g} {sum(kls) / len(kls):8.5f} {by:>18} {boot['ratio']:6.3f} "
                  f"[{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
