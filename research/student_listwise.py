"""Is it the student's loss or its inputs that keeps it behind H2O? (validation only)

The student (scdviz.evict.student) reads no attention: a linear map of H_in, log ||v||, log(1 + pos),
log(n - pos). This probe fits, on the same spread train contexts and future-attention teacher as
``fit-student --decode-len 0``, three designs: the student; the student plus log of SnapKV's window
attention (the last W prompt queries, per KV head: the group's query heads averaged, the rows
summed / W; cheap: W rows, not T); the student plus log of H2O's own score (every query row: not
cheap), a reference of what attention history can add. Each is fitted two ways: ridge regression
of the centred log future attention (fit-student's closed form), and a listwise loss from there:
per context and row, the cross-entropy between the softmax of the scores over the context and the
future attention normalised to a distribution (a weight of 1 on log H2O's score reproduces H2O's
ranking), an L2 penalty on the H_in weights, L-BFGS. It scores each on the fit's validation
contexts (calib) at 25 % and 12.5 % kept against H2O's top-B.

    SCDVIZ_THREADS=2 python -m research.student_listwise [--contexts 120] [--penalties 0 1e-3 1e-2]

Calib text only: for choices.
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
    """extra (R, T, 4) [log v, log1p pos, log age, 1] with the logs of ``cols`` ((Hkv or 1, T) each) before the 1."""
    rows, t = extra.shape[:2]
    added = [c.log() if c.shape[0] == rows else c.mean(0, keepdim=True).log() for c in cols]
    added = [c.expand(rows, t).unsqueeze(-1) for c in added]
    return torch.cat([extra[..., :3], *added, extra[..., 3:]], -1)


def listwise_fit(h, extra, target, start, penalty: float, iters: int):
    """One layer's weights (R, F) minimising the mean over contexts and rows of CE(target || softmax(scores)) +
    ``penalty`` x ||w_H||^2 per row: h (N, T, d) float16, extra (N, R, T, k), target (N, R, T) distributions,
    start (R, F) the ridge solution."""
    d = h.shape[-1]
    w = start.clone().float().requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=iters, line_search_fn="strong_wolfe", history_size=20)
    hf32 = h.float()

    def closure():
        opt.zero_grad()
        s = torch.einsum("ntd,rd->nrt", hf32, w[:, :d]) + (extra * w[None, :, None, d:]).sum(-1)
        loss = -(target * torch.log_softmax(s, -1)).sum(-1).mean() + penalty * (w[:, :d] ** 2).sum(-1).mean()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def main(argv: list[str] | None = None) -> None:
    from scdviz import metrics
    from scdviz.evict import features as F
    from scdviz.evict import student_fit as sf
    from scdviz.evict import train as trainer
    from scdviz.evict.student import Student
    from scdviz.models import hf
    from scdviz.models.pair import choose_threads, load_model
    from scdviz.progress import steps

    parser = argparse.ArgumentParser(prog="python -m research.student_listwise", description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=120)
    parser.add_argument("--val-contexts", type=int, default=24)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--penalties", type=float, nargs="+", default=[0.0, 1e-3, 1e-2])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--ridge", type=float, default=1.0, help="the starting point's ridge strength")
    args = parser.parse_args(argv)
    choose_threads()
    t0 = time.perf_counter()
    model, tokenizer = load_model("builtin:smollm2-135m")
    cfg = sf.FitConfig(contexts=args.contexts, val_contexts=args.val_contexts, decode_len=0)
    base = Student.for_model(model, cfg.student)
    n_layers, rows, f = base.weight.shape
    _, n_kv, _ = hf.attn_heads(model)
    t = cfg.context_len
    positions = torch.arange(t)
    designs = {"student": [], f"student + window {args.window}": [args.window], "student + H2O's score": [t]}

    def attention_cols(attn_layers):
        out = []
        for a in attn_layers:
            w = window_attention(a, args.window, n_kv)
            h2o = F.prefill_layer_features(a, torch.ones(1, n_kv, t, 1), t, n_kv)[0, ..., 0]
            out.append({args.window: w + EPS, t: h2o + EPS})
        return out

    normal = {name: sf.NormalEquations.zeros(n_layers, rows, f + len(ws)) for name, ws in designs.items()}
    hs = [[] for _ in range(n_layers)]
    extras = {name: [[] for _ in range(n_layers)] for name in designs}
    targets = [[] for _ in range(n_layers)]
    for window in steps(sf.windows(tokenizer, cfg, "train", cfg.contexts, t + cfg.teacher_len), "train contexts",
                        True):
        ids = hf.ids_tensor(window)
        with torch.no_grad(), hf.eager(model):
            trace = hf.forward(model, ids[:, :t], capture={"h_in"}, attentions=True, last_logits=True)
            cont = hf.forward(model, ids[:, t:], cache=hf.make_cache(model, trace.keys, trace.values),
                              attentions=True, last_logits=True)
        future = F.future_attention(cont.attn, t, n_kv)[0][:, 0]  # (L, Hkv, T)
        cols = attention_cols(trace.attn)
        for layer in range(n_layers):
            h, extra = sf.design_parts(base, trace.h_in[layer][0], trace.values[layer][0], positions, t)
            y = sf.teacher_rows(future[layer], True)
            hs[layer].append(h.half())
            p = future[layer].float()
            targets[layer].append(p / p.sum(-1, keepdim=True))
            for name, ws in designs.items():
                x = columns(extra, [cols[layer][w] for w in ws])
                normal[name].add(layer, h, x, y)
                extras[name][layer].append(x)
    print(f"collected {cfg.contexts} train contexts in {time.perf_counter() - t0:.0f} s", flush=True)

    fitted = {}
    for name in designs:
        start = normal[name].solve(args.ridge)
        fitted[(name, "ridge", args.ridge)] = start
        for penalty in args.penalties:
            t1 = time.perf_counter()
            weight = torch.stack([listwise_fit(torch.stack(hs[layer]), torch.stack(extras[name][layer]),
                                               torch.stack(targets[layer]), start[layer], penalty, args.iters)
                                  for layer in range(n_layers)])
            fitted[(name, "listwise", penalty)] = weight
            print(f"fitted {name} listwise, penalty {penalty:g}, in {time.perf_counter() - t1:.0f} s", flush=True)
    del hs, extras, targets

    val = sf.prepared_samples(model, tokenizer, cfg, "calib", cfg.val_contexts, True)
    val_windows = sf.windows(tokenizer, cfg, "calib", cfg.val_contexts, t + cfg.question_len + cfg.cont_len)
    val_cols = {}
    for i, window in enumerate(val_windows):
        with torch.no_grad(), hf.eager(model):
            trace = hf.forward(model, hf.ids_tensor(window)[:, :t], attentions=True, last_logits=True)
        val_cols[id(val[i])] = attention_cols(trace.attn)

    def scorer(weight, ws):
        def score(sample):
            out = []
            for layer, (h, v) in enumerate(zip(sample.obs.hidden, sample.obs.values, strict=True)):
                hh, extra = sf.design_parts(base, h[0], v[0], positions, t)
                x = columns(extra, [val_cols[id(sample)][layer][w] for w in ws])
                d = hh.shape[1]
                out.append(weight[layer, :, :d] @ hh.float().T + (x * weight[layer, :, None, d:]).sum(-1))
            return torch.cat(out, 0)
        return score

    h2o = trainer.validation_kls(model, lambda s: trainer.rows_of_feature(s.obs, True, 0), True, val, cfg.keeps)
    k = len(cfg.keeps)
    print(f"{cfg.val_contexts} calib contexts; H2O: {sum(h2o) / len(h2o):.5f} "
          + " / ".join(f"{sum(h2o[i::k]) / len(h2o[i::k]):.5f}" for i in range(k)) + f" at keeps {cfg.keeps}")
    print(f"{'design':28} {'loss':>9} {'pen.':>6} {'KL':>8} {'by keep':>16} {'x H2O':>6} [95% CI]")
    for (name, loss, setting), weight in fitted.items():
        kls = trainer.validation_kls(model, scorer(weight, designs[name]), True, val, cfg.keeps)
        boot = metrics.paired_bootstrap(h2o, kls)
        by = " / ".join(f"{sum(kls[i::k]) / len(kls[i::k]):.4f}" for i in range(k))
        print(f"{name:28} {loss:>9} {setting:6g} {sum(kls) / len(kls):8.5f} {by:>16} {boot['ratio']:6.3f} "
              f"[{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
