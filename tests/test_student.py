"""Fast tier: the DistillCache student (scdviz.evict.student) on tiny random models: its scores, its press,
decode-time arrival scores, the closed-form fit and its place in the eviction bench."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import tiny_model

from scdviz import artefact
from scdviz import config as cfgmod
from scdviz.evict import bench
from scdviz.evict.decode import DecodeEvictor
from scdviz.evict.policy import keep_count
from scdviz.evict.student import Student, StudentConfig, StudentPress, is_student, window_column
from scdviz.evict.student_fit import (
    FitConfig,
    Lists,
    NormalEquations,
    accumulate,
    decode_episodes,
    decode_kls,
    decoded_subset,
    design,
    design_parts,
    fit,
    listwise_layer,
    remove_checkpoint,
    teacher_distribution,
    teacher_rows,
)
from scdviz.models import hf
from scdviz.progress import Stopped


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _student(model, per_head: bool = True, seed: int = 0) -> Student:
    student = Student.for_model(model, StudentConfig(per_head=per_head))
    with torch.no_grad():
        student.weight.normal_(generator=torch.Generator().manual_seed(seed))
    return student.eval()


class _Words:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [sum(map(ord, w)) % 97 for w in text.split()]}


def test_scores_are_the_design_rows_times_the_weights_and_split_into_static_and_age():
    model = tiny_model("llama")
    student = _student(model)
    trace = hf.forward(model, _ids(20), capture={"h_in"})
    for layer in range(hf.n_layers(model)):
        h, v = trace.h_in[layer], trace.values[layer]
        scores = student(layer, h, v)  # (1, Hkv, T)
        x = design(student, h[0], v[0], torch.arange(20), 20)  # (Hkv, T, d + 4)
        torch.testing.assert_close(scores[0], (x @ student.weight[layer].unsqueeze(-1))[..., 0], atol=1e-4, rtol=1e-4)
        # by hand: the last column is the intercept, the one before it log(n - pos)
        w = student.weight[layer]
        age = w[:, -2, None] * torch.log(20.0 - torch.arange(20.0))
        torch.testing.assert_close(student.age(layer, torch.arange(20), 20), age)
        torch.testing.assert_close(student.static(layer, h, v, torch.arange(20)) + age, scores, atol=1e-4, rtol=1e-4)


def test_ridge_solution_recovers_an_exact_linear_teacher():
    model = tiny_model("llama")
    student = Student.for_model(model)
    n_layers, rows, f = student.weight.shape
    truth = torch.randn(n_layers, rows, f, generator=torch.Generator().manual_seed(3))
    normal = NormalEquations(torch.zeros(n_layers, rows, f, f, dtype=torch.float64),
                     torch.zeros(n_layers, rows, f, dtype=torch.float64))
    for seed in range(4):  # 4 x 30 rows > 36 columns
        trace = hf.forward(model, _ids(30, seed), capture={"h_in"})
        for layer in range(n_layers):
            h, extra = design_parts(student, trace.h_in[layer][0], trace.values[layer][0], torch.arange(30), 30)
            x = design(student, trace.h_in[layer][0], trace.values[layer][0], torch.arange(30), 30)
            normal.add(layer, h, extra, (x @ truth[layer].unsqueeze(-1))[..., 0])
    dense = x.double().transpose(1, 2) @ x.double()  # the last context's block sums equal the dense product
    single = NormalEquations(torch.zeros_like(normal.xtx), torch.zeros_like(normal.xty))
    single.add(n_layers - 1, h, extra, torch.zeros(rows, 30))
    torch.testing.assert_close(single.xtx[-1], dense, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(normal.solve(1e-9), truth, atol=2e-3, rtol=2e-3)
    assert (normal.solve(1e4) - truth).abs().mean() > (normal.solve(1e-9) - truth).abs().mean()  # shrinkage


def test_ridge_solution_at_the_real_width_on_two_threads_equals_each_layers_own_solve():
    # torch's batched LU solve failed on CPU with 2 threads at this size; the solve must not depend on it
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 700, 580, dtype=torch.float64, generator=gen)
    y = torch.randn(4, 3, 700, dtype=torch.float64, generator=gen)
    normal = NormalEquations(x.transpose(-1, -2) @ x, (x.transpose(-1, -2) @ y.unsqueeze(-1))[..., 0])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = normal.solve(10.0)
    finally:
        torch.set_num_threads(threads)
    eye = torch.eye(580, dtype=torch.float64)
    eye[-1, -1] = 0  # the intercept is not shrunk
    for layer, row in ((0, 0), (3, 2)):
        a = normal.xtx[layer, row]
        want = torch.linalg.solve(a + 10.0 * 1e-3 * a.diagonal().mean() * eye, normal.xty[layer, row])
        torch.testing.assert_close(got[layer, row], want.float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("per_head", [True, False])
def test_press_keeps_exactly_the_top_student_scores_with_sdpa_attention(per_head):
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")  # the student reads no attention probabilities
    student, ids = _student(model, per_head), _ids(24)
    press = StudentPress.keeping(student, 0.25)
    with press(model):
        pruned = hf.forward(model, ids)
    full = hf.forward(model, ids, capture={"h_in"})
    for layer, (keys, values) in enumerate(zip(full.keys, full.values, strict=True)):
        scores = student(layer, full.h_in[layer], values)
        idx = scores.topk(6, dim=-1).indices
        torch.testing.assert_close(pruned.keys[layer], keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, 8)))
        assert torch.equal(press.carried[layer][0], idx)
        if not per_head:  # one kept set per layer, shared by its heads
            assert all(set(idx[0, h].tolist()) == set(idx[0, 0].tolist()) for h in range(idx.shape[1]))


@pytest.mark.parametrize("per_head", [True, False])
def test_decode_eviction_keeps_each_tokens_arrival_score_and_holds_the_budget(per_head):
    """After a press prefill, the evictor continues from the press's kept tokens; every token's static score is
    computed once, when it arrives, and equals the one a full forward gives it (layer 0, where a token's input
    depends on nothing before it); the cache stays at the budget."""
    model = tiny_model("llama")
    student, prompt, steps = _student(model, per_head), _ids(24), 6
    press = StudentPress.keeping(student, 0.5)
    with press(model):
        cache = hf.forward(model, prompt[:, :-1]).cache
    n_keep = keep_count(23, 0.5)
    evictor = DecodeEvictor(press, budget=n_keep, window=4)
    lengths = []
    with evictor(model):
        out = hf.generate(model, cache, prompt[:, -1:], 23, steps, on_step=lambda c, s: lengths.append(hf.cache_len(c)))
    assert lengths == [[n_keep] * 3] * steps and evictor.evictions == 3 * steps
    state = evictor.states[0]
    full = hf.forward(model, torch.cat([prompt, torch.tensor([out[:-1]])], 1), capture={"h_in"})
    ref = student.static(0, full.h_in[0], full.values[0], torch.arange(full.values[0].shape[2]))
    rows = state.static.shape[1]
    torch.testing.assert_close(state.static, ref.gather(2, state.positions[:, :rows]), atol=1e-4, rtol=1e-4)
    assert int(state.positions.max()) >= 23  # generated tokens were kept where they scored high enough


def test_sinks_are_kept_at_prefill_and_through_decode_eviction_and_named():
    """StudentConfig.sinks: the first positions outrank every fitted score, so top-B keeps them at prefill and
    the decode-time cuts never drop them; with sinks 0 the same weights drop position 0 (the test's premise)."""
    model = tiny_model("llama")
    student, prompt = _student(model), _ids(24)
    with torch.no_grad():  # make position 0 the lowest-scored token of every row
        student.weight[:, :, student.hidden + 1] = 5.0  # w . log(1 + pos): 0 at position 0, > 0 after it
    n_keep = keep_count(23, 0.25)
    trace = hf.forward(model, prompt[:, :-1], capture={"h_in"})
    kept = [student(layer, trace.h_in[layer], trace.values[layer])[0].topk(n_keep, -1).indices
            for layer in range(hf.n_layers(model))]
    assert all(0 not in k.tolist() for layer in kept for k in layer)
    sunk = Student.for_model(model, dataclasses.replace(student.config, sinks=2))
    with torch.no_grad():
        sunk.weight.copy_(student.weight)
    scores = sunk(0, trace.h_in[0], trace.values[0])
    torch.testing.assert_close(scores[..., 2:], student(0, trace.h_in[0], trace.values[0])[..., 2:])
    press = StudentPress.keeping(sunk, 0.25)
    with press(model):
        cache = hf.forward(model, prompt[:, :-1]).cache
    evictor = DecodeEvictor(press, budget=n_keep, window=4)
    with evictor(model):
        hf.generate(model, cache, prompt[:, -1:], 23, 8)
    assert evictor.evictions > 0
    for state in evictor.states.values():
        assert all({0, 1} <= set(row.tolist()) for row in state.positions[0])
    assert bench.student_name(sunk) == "distilled-scorer-closed-form"  # a name says what it is, not its knobs
    sunk.log, sunk.meta = {"config": {"decode_len": 128}}, {"listwise_penalty": 1e-3}  # decode states, listwise
    assert bench.student_name(sunk) == "distilled-scorer"


def test_decode_eviction_with_a_student_needs_its_prefill_scores():
    model = tiny_model("llama")
    cache = hf.forward(model, _ids(20)).cache
    with pytest.raises(ValueError, match="prefill_scores"), DecodeEvictor(StudentPress(student=_student(model)),
                                                                           budget=8)(model):
        hf.generate(model, cache, _ids(1), 20, 2)


def test_student_round_trips_and_refuses_a_model_of_another_shape(tmp_path):
    model = tiny_model("llama")
    student = _student(model, per_head=False)
    student.meta, student.log = {"val_kl": 0.5}, {"val": [{"ridge": 10.0, "kl": 0.5}]}
    student.save(tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["best.safetensors", "log.json"]
    back = Student.load(tmp_path / "s")
    assert torch.equal(back.weight, student.weight) and back.config == student.config and back.log == student.log
    assert is_student(tmp_path / "s") and not is_student(tmp_path / "nothing")
    with pytest.raises(ValueError, match="3 layers, 2 KV heads and width 32"):
        StudentPress(student=back).post_init_from_model(tiny_model("llama", num_hidden_layers=2))


def test_fit_chooses_the_ridge_with_the_lowest_validation_kl_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tiny_model("llama")
    cfg = FitConfig(corpora=("austen", "gcide"), contexts=4, val_contexts=2, context_len=40, teacher_len=8,
                    cont_len=4, question_len=2, ridges=(0.1, 1000.0), decode_len=0, val_decode=0, listwise=())
    student = fit(cfg, (model, _Words(), "tiny"), progress=False)
    assert list(tmp_path.iterdir()) == []
    log = student.log
    assert [v["ridge"] for v in log["val"]] == [0.1, 1000.0] and log["rows"] == 4 * 40
    best = min(log["val"], key=lambda v: v["kl"])
    assert student.config.ridge == best["ridge"] and student.meta["val_kl"] == best["kl"] == log["closed_form_kl"]
    assert len(log["h2o_per_context"]) == 2 * 2 and log["val_heuristic"] > 0
    assert student.meta["flops_per_token_layer"] == 2 * 2 * (32 + 4) + 2 * 2 * 8
    json.dumps(log)  # the log is JSON
    assert student.stages["closed_form"] is student and not student.training  # no listwise stage: the closed form
    assert bench.student_name(student) == "distilled-scorer-closed-form"


def test_listwise_stage_recovers_a_softmax_teacher_up_to_the_intercept(tmp_path):
    gen = torch.Generator().manual_seed(0)
    n, t, d, rows = 6, 20, 5, 2
    truth = torch.randn(rows, d + 4, generator=gen)
    lists = Lists(tmp_path / "spool", 1)
    for _ in range(n):
        h = torch.randn(t + 4, d, generator=gen)  # the context's rows, then a decode state's 4 more
        lists.set_hidden(0, h)
        for now in (t, t + 4):
            extra = torch.randn(rows, now, 4, generator=gen)
            extra[..., 3] = 1  # the intercept column
            scores = h[:now].half().float() @ truth[:, :d].T + (extra * truth[:, None, d:]).sum(-1).T
            lists.add(0, extra, torch.softmax(scores.T, -1))
        lists.flush()
    got = listwise_layer(lists, 0, torch.zeros(rows, d + 4), 0.0, 0.5, 200)
    torch.testing.assert_close(got[:, : d + 3], truth[:, : d + 3], atol=2e-3, rtol=2e-3)  # softmax ignores the 1
    penalised = listwise_layer(lists, 0, torch.zeros(rows, d + 4), 1.0, 0.5, 200)
    assert penalised[:, :d].norm() < got[:, :d].norm()  # the L2 penalty shrinks the H_in weights
    share = teacher_distribution(torch.tensor([[1.0, 3.0], [2.0, 2.0]]), per_head=False)
    torch.testing.assert_close(share, torch.tensor([[0.375, 0.625]]))  # the heads' mean, normalised


def test_the_listwise_spool_reads_back_each_layer_exactly_and_only_that_layer(tmp_path):
    gen = torch.Generator().manual_seed(1)
    lists = Lists(tmp_path / "spool", 2)
    added = []
    for _ in range(3):
        context = {}
        for layer in range(2):
            lists.set_hidden(layer, torch.randn(7, 5, generator=gen))  # replaced by the longer rows below
            h = torch.randn(9, 5, generator=gen)
            lists.set_hidden(layer, h)
            for now in (7, 9):
                extra, target = torch.randn(2, now, 4, generator=gen), torch.rand(2, now, generator=gen)
                lists.add(layer, extra, target)
                context[layer, now] = (extra, target)
            context[layer] = h
        lists.flush()
        added.append(context)
    lists.flush()  # nothing set since the last: no empty context
    assert lists.contexts == 3 and len(list((tmp_path / "spool").iterdir())) == 3
    for layer in range(2):
        h, by_now = lists.layer(layer)
        assert h.dtype == torch.float32 and torch.equal(h, torch.stack([c[layer].half().float() for c in added]))
        assert sorted(by_now) == [7, 9]
        for now, (extra, target) in by_now.items():
            assert torch.equal(extra, torch.stack([c[layer, now][0] for c in added]))
            assert torch.equal(target, torch.stack([c[layer, now][1] for c in added]))


@pytest.mark.parametrize("window", [0, 4])
def test_fit_runs_the_listwise_stage_after_the_closed_form_and_keeps_the_better_on_validation(tmp_path, monkeypatch,
                                                                                            window):
    monkeypatch.chdir(tmp_path)
    model = tiny_model("llama")
    cfg = FitConfig(corpora=("austen", "gcide"), contexts=4, val_contexts=2, context_len=40, teacher_len=8,
                    cont_len=4, question_len=2, ridges=(0.1, 1000.0), decode_len=6, decode_every=3,
                    decode_weights=(0.3,), val_decode=2, val_decode_tokens=8, decode_interval=4,
                    listwise=(0.0, 1.0), listwise_iters=5, student=StudentConfig(window=window),
                    out=str(tmp_path / "run"))
    spooled = []
    real_flush = Lists.flush
    monkeypatch.setattr(Lists, "flush", lambda self: (spooled.append(self.folder), real_flush(self))[1])
    student = fit(cfg, (model, _Words(), "tiny"), progress=False)
    # the lists went to disk inside the run's folder (the fit's temporary folder there), one file per training
    # context, and are gone now
    assert len(spooled) == 4 and all(tmp_path / "run" in p.parents for p in spooled)
    assert not any((tmp_path / "run").iterdir())
    vals = student.log["val"]
    assert [(v["ridge"] if "listwise_penalty" not in v else None, v.get("listwise_penalty")) for v in vals][:2] == \
        [(0.1, None), (1000.0, None)] and [v["listwise_penalty"] for v in vals[2:]] == [0.0, 1.0]
    closed_row = min(vals[:2], key=lambda v: v["kl"] / student.log["val_heuristic"]
                     + v["decode_kl"] / student.log["val_decode_heuristic"])
    assert all(v["ridge"] == closed_row["ridge"] and v["decode_weight"] == 0.3 for v in vals[2:])  # from its pick
    closed = student.stages["closed_form"]
    assert closed.config.ridge == closed_row["ridge"] and student.log["closed_form_kl"] == closed_row["kl"]
    choice = {id(v): v["kl"] / student.log["val_heuristic"] + v["decode_kl"] / student.log["val_decode_heuristic"]
              for v in vals}
    best = min(vals, key=lambda v: choice[id(v)])
    assert student.meta["val_kl"] == best["kl"] and student.meta["listwise_penalty"] == best.get("listwise_penalty")
    assert closed.meta["listwise_penalty"] is None
    assert bench.student_name(closed) == "distilled-scorer-closed-form"
    assert bench.student_name(student) == ("distilled-scorer" if "listwise_penalty" in best
                                           else "distilled-scorer-closed-form")
    assert student.weight.shape[-1] == student.hidden + 4 + bool(window) and student.config.window == window
    assert not torch.equal(student.weight, closed.weight) == ("listwise_penalty" in best)


def _resumable(**overrides) -> FitConfig:
    """A tiny fit with every stage: decode states, decode validation and the listwise stage (whose spool a resumed
    fit must have whole)."""
    return FitConfig(**{**dict(corpora=("austen", "gcide"), contexts=4, val_contexts=2, context_len=40, teacher_len=8,
                                cont_len=4, question_len=2, ridges=(0.1, 1000.0), decode_len=6, decode_every=3,
                                decode_weights=(0.3,), val_decode=2, val_decode_tokens=8, decode_interval=4,
                                listwise=(0.0,), listwise_iters=5), **overrides})


def test_a_fit_stopped_after_k_contexts_resumes_from_its_folder_to_the_uninterrupted_student_bit_for_bit(tmp_path):
    model = tiny_model("llama")
    cfg, work = _resumable(), tmp_path / "work"
    whole = fit(cfg, (model, _Words(), "tiny"), progress=False)

    def stop_after_two(desc, done, total):  # the visitor cancels once two training contexts are in
        if desc.startswith("student: prefill and teacher") and done == 2:
            raise Stopped("stopped")

    with pytest.raises(Stopped):
        fit(cfg, (model, _Words(), "tiny"), progress=stop_after_two, folder=work)
    state = json.loads((work / "checkpoint.json").read_text())
    assert (state["done"], state["rows"], state["decode_rows"]) == (2, 2 * 40, 2 * (40 + 3))  # one state: s = 3 of 6
    assert sorted(p.name for p in (work / "listwise").iterdir()) == ["context-00000.safetensors",
                                                                     "context-00001.safetensors"]
    seen = []
    again = fit(cfg, (model, _Words(), "tiny"), progress=lambda desc, done, total: seen.append((desc, total)),
                folder=work)
    assert {total for desc, total in seen if desc.startswith("student: prefill and teacher")} == {2}  # only the rest
    assert torch.equal(again.weight, whole.weight)
    assert torch.equal(again.stages["closed_form"].weight, whole.stages["closed_form"].weight)
    mine, theirs = ({k: v for k, v in s.log.items() if k not in ("seconds", "resumed_at")} for s in (again, whole))
    assert mine == theirs and again.log["resumed_at"] == [2] and "resumed_at" not in whole.log
    assert again.meta == whole.meta and again.config == whole.config
    assert json.loads((work / "checkpoint.json").read_text())["done"] == 4  # kept until the caller removes it
    remove_checkpoint(work)
    assert not work.exists()


def test_an_error_inside_a_context_leaves_the_checkpoint_before_it_and_the_resumed_sums_are_exact(tmp_path,
                                                                                                 monkeypatch):
    import scdviz.evict.student_fit as sf

    model = tiny_model("llama")
    cfg = FitConfig(corpora=("austen",), contexts=3, context_len=12, teacher_len=4, decode_len=6, decode_every=3)
    student = Student.for_model(model)
    whole = accumulate(model, _Words(), cfg, student, False)
    monkeypatch.setattr(sf, "CHECKPOINT_EVERY", 1)
    real, calls, layers = sf.NormalEquations.add, [], student.weight.shape[0]

    def killed_in_the_third(self, *args, **kwargs):  # the third context's second layer: its first layer is in
        if self.decode is not None:  # the prefill rows' equations (the decode states' have none of their own)
            calls.append(1)
            if len(calls) == 2 * layers + 2:
                raise RuntimeError("killed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sf.NormalEquations, "add", killed_in_the_third)
    with pytest.raises(RuntimeError, match="killed"):
        accumulate(model, _Words(), cfg, student, False, folder=tmp_path)
    assert json.loads((tmp_path / "checkpoint.json").read_text())["done"] == 2  # the half context is not in it
    monkeypatch.setattr(sf.NormalEquations, "add", real)
    again = accumulate(model, _Words(), cfg, student, False, folder=tmp_path)
    assert again.resumed_at == [2] and (again.rows, again.decode.rows) == (whole.rows, whole.decode.rows)
    got, want = again.tensors(), whole.tensors()
    assert sorted(got) == sorted(want) and all(torch.equal(got[name], want[name]) for name in want)


def test_a_checkpoint_of_another_fit_is_refused_naming_what_differs(tmp_path):
    model = tiny_model("llama")
    cfg = FitConfig(corpora=("austen",), contexts=2, context_len=12, teacher_len=4, decode_len=0, listwise=())
    accumulate(model, _Words(), cfg, Student.for_model(model), False, folder=tmp_path)
    before = (tmp_path / "checkpoint.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"checkpoint of another fit \(contexts: 2 there, 3 here; "
                                         r"student.window: 0 there, 4 here\)"):
        fit(dataclasses.replace(cfg, contexts=3, student=StudentConfig(window=4)), (model, _Words(), "tiny"),
            progress=False, folder=tmp_path)
    with pytest.raises(ValueError, match="checkpoint of another fit \\(another model"):
        fit(cfg, (tiny_model("llama", seed=1), _Words(), "tiny"), progress=False, folder=tmp_path)
    assert (tmp_path / "checkpoint.safetensors").read_bytes() == before  # refused before any work
    with pytest.raises(ValueError, match=r"checkpoint of another fit \(listwise: False there, True here\)"):
        fit(dataclasses.replace(cfg, listwise=(1e-3,)), (model, _Words(), "tiny"), progress=False,
            folder=tmp_path)  # its sums have no listwise spool beside them
    # where the student is written and what is chosen after the sums (validation, ridges, the student's ridge): the
    # same sums, resumed with all their contexts in already
    later = dataclasses.replace(cfg, out="elsewhere", val_contexts=3, keeps=(0.5,), ridges=(3.0,), cont_len=5,
                                decode_weights=(1.0,), listwise_iters=2, student=StudentConfig(ridge=1.0))
    again = accumulate(model, _Words(), later, Student.for_model(model), False, folder=tmp_path)
    assert again.resumed_at == [2] and again.rows == 2 * 12
    assert (tmp_path / "checkpoint.safetensors").read_bytes() == before


def test_bench_scores_a_student_in_the_shared_prefill_never_as_a_baseline(tmp_path):
    model = tiny_model("llama")
    student = _student(model)
    student.log = {"config": {"question_len": 0}, "val": [{"ridge": 10.0, "kl": 0.01}]}
    student.meta = {"val_kl": 0.009, "listwise_penalty": 1e-3}
    student.stages = {"closed_form": _student(model, seed=1)}
    student.stages["closed_form"].meta = {"val_kl": 0.01}
    student.save(tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["best.safetensors", "closed_form.safetensors",
                                                                  "log.json"]
    loaded = bench.load_all((str(tmp_path / "s"), str(tmp_path / "s" / "closed_form.safetensors")))
    assert list(loaded) == ["distilled-scorer", "distilled-scorer-closed-form"]
    assert [p.validation_kl for p in loaded.values()] == [0.009, 0.01]  # each its own, from one log
    cfg = bench.EvalConfig(policies=(str(tmp_path / "s" / "best.safetensors"),), corpora=("austen", "gcide"), limit=2,
                           context_len=40, cont_len=6, question_len=0, keeps=(0.25,), token_budgets=(), natives=False,
                           decode_tokens=8, decode_interval=4)
    assert bench.chosen_on_validation((str(tmp_path / "s"),)) == "distilled-scorer"
    record = bench.run(cfg, (model, _Words(), "tiny"))
    mine = [r for r in record.rows if r.get("method") == "distilled-scorer"]
    assert {r["mode"] for r in mine} == {"agnostic", "agnostic decode8"}
    assert all(not r["baseline"] and r["chosen_on_validation"] and r["n_contexts"] == 2 for r in mine)
    assert all(r["best_baseline"] != "distilled-scorer" for r in record.rows if "best_baseline" in r)


def test_teacher_rows_are_the_centred_log_future_attention():
    future = torch.rand(2, 6, generator=torch.Generator().manual_seed(1))
    alone = teacher_rows(future, True)
    torch.testing.assert_close(alone, (future + 1e-7).log() - (future + 1e-7).log().mean(-1, keepdim=True))
    layer = teacher_rows(future, False)  # one row per layer: the heads' mean
    assert layer.shape == (1, 6) and torch.allclose(layer.sum(), torch.tensor(0.0), atol=1e-5)


def test_bench_reports_a_student_fitted_for_another_model_instead_of_failing(tmp_path):
    model = tiny_model("llama")
    other = _student(tiny_model("llama", num_hidden_layers=2))
    other.save(tmp_path / "other")
    cfg = bench.EvalConfig(policies=(str(tmp_path / "other" / "best.safetensors"),), corpora=("austen",), limit=1,
                           context_len=40, cont_len=6, question_len=0, keeps=(0.25,), token_budgets=(), natives=False)
    rows = bench.run(cfg, (model, _Words(), "tiny")).rows
    [row] = [r for r in rows if r.get("method") == "distilled-scorer-closed-form"]
    assert "fitted for 2 layers" in row["cannot_run"] and any(r.get("method") == "Knorm" for r in rows)


def test_decode_states_add_each_generated_states_rows_at_its_age():
    from scdviz.evict import features as F

    model = tiny_model("llama")
    base = dict(corpora=("austen",), contexts=1, context_len=12, teacher_len=4)
    student = Student.for_model(model)
    plain = accumulate(model, _Words(), FitConfig(**base, decode_len=0), student, progress=False)
    more = accumulate(model, _Words(), FitConfig(**base, decode_len=8, decode_every=3), student, progress=False)
    assert plain.rows == more.rows == 12 and plain.decode is None
    assert more.decode.rows == (12 + 3) + (12 + 6)  # states after 3 and 6 generated tokens
    # by hand: the context, the model's greedy generation after it, one eager pass over both
    window = __import__("scdviz.evict.student_fit", fromlist=["windows"]).windows(
        _Words(), FitConfig(**base), "train", 1, 16)[0]
    ids = torch.tensor([window[:13]])
    prefill = hf.forward(model, ids[:, :12])
    gen = hf.generate(model, prefill.cache, ids[:, 12:13], 12, 8)
    every = torch.cat([ids, torch.tensor([gen[:-1]])], 1)  # context, then the 8 decode steps' inputs
    with hf.eager(model):
        whole = hf.forward(model, every, capture={"h_in"}, attentions=True)
    hand = NormalEquations(torch.zeros_like(more.xtx), torch.zeros_like(more.xty))
    for s in (3, 6):
        now = 12 + s
        future = F.future_attention([a[..., now:, :now] for a in whole.attn], now, 2)[0][:, 0]
        for layer in range(hf.n_layers(model)):
            h, extra = design_parts(student, whole.h_in[layer][0, :now], whole.values[layer][0, :, :now],
                                    torch.arange(now), now)
            hand.add(layer, h, extra, teacher_rows(future[layer], True))
    torch.testing.assert_close(more.xtx, plain.xtx)  # the prefill rows alike; the decode states' apart
    torch.testing.assert_close(more.decode.xtx, hand.xtx, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(more.decode.xty, hand.xty, atol=1e-5, rtol=1e-4)
    # a decode weight w solves the prefill rows plus w x the decode rows (their normal equations summed)
    summed = NormalEquations(plain.xtx + 0.3 * hand.xtx, plain.xty + 0.3 * hand.xty)
    torch.testing.assert_close(more.solve(10.0, decode_weight=0.3), summed.solve(10.0), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(more.solve(10.0, decode_weight=1.0), summed.solve(10.0), atol=1e-3)


def test_decode_validation_is_zero_with_the_whole_cache_kept_and_no_cut_and_drives_the_choice(tmp_path, monkeypatch):
    from scdviz.evict import train as trainer

    monkeypatch.chdir(tmp_path)
    model = tiny_model("llama")
    cfg = FitConfig(corpora=("austen", "gcide"), contexts=2, val_contexts=2, context_len=40, teacher_len=8,
                    cont_len=4, question_len=2, ridges=(0.1, 1000.0), decode_len=6, decode_every=3,
                    val_decode=2, val_decode_tokens=10, decode_interval=4, listwise=())
    samples = trainer.prepare(model, _Words(), trainer.TrainConfig(out="x", corpora=cfg.corpora, context_len=40,
                                                                   cont_len=4, question_len=2), "calib", 2, False,
                              hidden=True)
    assert decoded_subset(list(range(24)), 12) == list(range(0, 24, 2)) and decoded_subset([7], 3) == [7]
    episodes = decode_episodes(model, samples, 10)
    assert [e.cont.shape[1] for e in episodes] == [10, 10]
    student = _student(model)
    for who in (None, student):
        assert all(v < 1e-6 for v in decode_kls(model, episodes, 1.0, 11, who))  # all kept, never cut
        held = decode_kls(model, episodes, 0.25, 4, who)
        assert all(v > 1e-4 for v in held)
    fitted = fit(cfg, (model, _Words(), "tiny"), progress=False)
    vals = fitted.log["val"]
    assert all(len(v["decode_kl_per_context"]) == 2 for v in vals) and fitted.log["val_decode_heuristic"] > 0
    h2o = fitted.log["val_heuristic"], fitted.log["val_decode_heuristic"]
    chosen = min(vals, key=lambda v: v["kl"] / h2o[0] + v["decode_kl"] / h2o[1])  # each KL over H2O's
    assert {v["decode_weight"] for v in vals} == set(cfg.decode_weights) and len(vals) == 2 * len(cfg.decode_weights)
    assert fitted.config.ridge == chosen["ridge"] and fitted.meta["val_decode_kl"] == chosen["decode_kl"]


# ----------------------------------------------------------------------------- the window column


def _windowed(model, window: int = 4, per_head: bool = True, seed: int = 0) -> Student:
    student = Student.for_model(model, StudentConfig(per_head=per_head, window=window))
    with torch.no_grad():
        student.weight.normal_(generator=torch.Generator().manual_seed(seed))
    return student.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_window_rows_from_the_layers_own_queries_equal_eager_attentions_last_rows(kind):
    """hf.window_rows recomputes the last W rows of a prefill's attention from H_in (q_proj, q_norm on qwen3,
    RoPE): the rows eager attention returns, causal pattern included."""
    model = tiny_model(kind)
    ids = _ids(16)
    with hf.eager(model):
        trace = hf.forward(model, ids, capture={"h_in"}, attentions=True)
    for layer in range(hf.n_layers(model)):
        rows = hf.window_rows_at(model, layer, trace.h_in[layer][:, -5:], trace.keys[layer])
        torch.testing.assert_close(rows, trace.attn[layer][:, :, -5:].float(), atol=1e-5, rtol=1e-4)
        assert torch.all(rows[:, :, 0, -4:] == 0)  # the window's first query sees none of the 4 tokens after it


def test_window_column_is_the_rows_mean_over_the_window_and_each_kv_heads_query_heads():
    rows = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32).view(2, 4, 3, 5)  # (B, H = 4, W = 3, T = 5), Hkv = 2
    col = window_column(rows, 2)
    by_hand = torch.stack([(rows[:, 0].sum(1) + rows[:, 1].sum(1)) / 6, (rows[:, 2].sum(1) + rows[:, 3].sum(1)) / 6], 1)
    torch.testing.assert_close(col, by_hand)


@pytest.mark.parametrize("per_head", [True, False])
def test_window_student_is_its_design_rows_times_weights_and_its_press_agrees_under_sdpa_and_eager(per_head):
    """With a window the score gains w x log(window column + eps) before the intercept; the press computes the
    rows itself under SDPA and reads eager's: the same scores, and it keeps exactly their top-B."""
    model = tiny_model("llama")
    student, ids = _windowed(model, 4, per_head), _ids(24)
    with hf.eager(model):
        full = hf.forward(model, ids, capture={"h_in"}, attentions=True)
    kept = {}
    for impl in ("sdpa", "eager"):
        press = StudentPress.keeping(student, 0.25)
        with hf.attention(model, impl), press(model):
            pruned = hf.forward(model, ids)
        kept[impl] = [press.carried[layer][0] for layer in range(hf.n_layers(model))]
        for layer, (keys, values) in enumerate(zip(full.keys, full.values, strict=True)):
            column = window_column(full.attn[layer][:, :, -4:], 2)
            scores = student(layer, full.h_in[layer], values, column=column)
            x = design(student, full.h_in[layer][0], values[0], torch.arange(24), 24, column[0])
            assert x.shape[-1] == student.hidden + 5
            rows = student.weight.shape[1]
            torch.testing.assert_close(scores[0, :rows], (x @ student.weight[layer].unsqueeze(-1))[..., 0], atol=1e-4,
                                       rtol=1e-4)
            # by hand: the window's weight times the log of the column, on top of the student without it
            plain = student.static(layer, full.h_in[layer], values, torch.arange(24)) + student.age(
                layer, torch.arange(24), 24)
            c = column if per_head else column.mean(1, keepdim=True)
            torch.testing.assert_close(scores[:, :rows], plain + student.weight[layer, :, -2, None] * (c + 1e-6).log(),
                                       atol=1e-4, rtol=1e-4)
            idx = scores.topk(6, dim=-1).indices
            torch.testing.assert_close(pruned.keys[layer], keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, 8)),
                                       atol=1e-5, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(kept["sdpa"], kept["eager"], strict=True))
    with pytest.raises(ValueError, match="window column"):
        student(0, full.h_in[0], full.values[0])


def test_window_student_decodes_from_the_last_w_attention_rows_and_refuses_sdpa_decoding():
    """While decoding, the window column is the mean of the last W attention rows the evictor buffered (the kept
    tokens' columns); a cut's scores are arrival + age + window terms; SDPA decoding (no rows) is refused."""
    model = tiny_model("llama")
    student, prompt, steps = _windowed(model, 3), _ids(24), 7
    press = StudentPress.keeping(student, 0.5)
    with press(model):
        cache = hf.forward(model, prompt[:, :-1]).cache
    n_keep = keep_count(23, 0.5)
    with pytest.raises(ValueError, match="eager attention or hf.ROWS"), hf.attention(model, "sdpa"), \
            DecodeEvictor(press, budget=n_keep, interval=2)(model):
        hf.generate(model, hf.clone_cache(model, cache), prompt[:, -1:], 23, 2)
    seen = {}

    def spy(module, hidden, keys, values, attn, kwargs):
        if module.layer_idx == 0:
            seen.setdefault("rows", []).append((attn.float(), keys.shape[2]))

    evictor = DecodeEvictor(press, budget=n_keep, interval=2)
    with hf.eager(model), evictor(model), hf.attention_hook(model, spy):
        hf.generate(model, cache, prompt[:, -1:], 23, steps)
    assert evictor.evictions > 0 and all(n <= n_keep + 1 for n in hf.cache_len(cache))
    state = evictor.states[0]
    state.merged(state.positions.shape[2], 3)  # the rows since the last cut
    assert state.rows.shape[2] == 3 and state.rows.shape[3] == state.positions.shape[2]
    rows_sum = state.rows.sum(-1)
    assert torch.all((rows_sum > 0.2) & (rows_sum <= 1 + 1e-5))  # each row: a distribution, minus evicted tokens
    # with no cut, the buffer is exactly the last 3 steps' rows, each padded with zeros for the tokens after it
    seen.clear()
    whole = hf.forward(model, prompt[:, :-1], capture={"h_in"})
    arrival = [student.static(layer, h, v, torch.arange(23)) for layer, (h, v) in
               enumerate(zip(whole.h_in, whole.values, strict=True))]
    roomy = DecodeEvictor(StudentPress(student=student), budget=100, interval=2, prefill_scores=arrival,
                          prefill_positions=[torch.arange(23).view(1, 1, 23).expand(1, 2, 23)] * 3)
    with hf.eager(model), roomy(model), hf.attention_hook(model, spy):
        hf.generate(model, whole.cache, prompt[:, -1:], 23, steps)
    tk = seen["rows"][-1][1]
    assert tk == 23 + steps and roomy.evictions == 0  # nothing cut
    last3 = [torch.nn.functional.pad(r, (0, tk - n)) for r, n in seen["rows"][-3:]]
    assert len(roomy.states[0].pending) < 3  # merged once W rows wait, so a cache never cut holds no more
    torch.testing.assert_close(roomy.states[0].merged(tk, 3), torch.cat(last3, 2))
    assert roomy.states[0].pending == []
    scores = evictor._scores(type("M", (), {"layer_idx": 0})(), state, torch.zeros(1, 2, state.static.shape[-1], 8),
                             None, {})
    now = int(state.positions.max()) + 1
    want = state.static + student.age(0, state.positions, now) + student.window_term(0, window_column(state.rows, 2))
    torch.testing.assert_close(scores, want)


def test_window_student_round_trips_and_a_windowless_file_refuses_window_weights(tmp_path):
    model = tiny_model("llama")
    student = _windowed(model, 8, per_head=False)
    student.save(tmp_path / "w.safetensors")
    back = Student.load(tmp_path / "w.safetensors")
    assert back.config.window == 8 and torch.equal(back.weight, student.weight)
    assert back.flops_per_token(8, 4, 64) == (2 * (32 + 5) + 2 * 2 * 8) + 2 * 8 * 4 * 8 + 2 * 8 * 32 * 4 * 8 // 64
    plain = Student.for_model(model)
    artefact.save(tmp_path / "bad.safetensors", "distillcache-student", {"weight": student.weight.detach()}, {},
                  cfgmod.to_dict(plain.config) | {"n_kv": 2, "hidden": 32}, {})
    with pytest.raises(ValueError, match="do not fit its config"):
        Student.load(tmp_path / "bad.safetensors")


def test_fit_with_a_window_regresses_the_prefill_window_and_each_decode_states_last_w_generated_rows():
    """The closed form's rows carry the window column: at prefill the last W prompt queries' attention
    (hf.window_rows), at a decode state of s generated tokens the attention rows of generated tokens s - W .. s - 1
    over the state's tokens."""
    model = tiny_model("llama")
    cfg = FitConfig(contexts=1, context_len=16, teacher_len=4, decode_len=9, decode_every=4, listwise=(),
                    student=StudentConfig(window=3))
    base = Student.for_model(model, cfg.student)
    added = []
    real_add = NormalEquations.add

    def spy(self, layer, hidden, extra, y):
        added.append((layer, hidden.shape[0], extra))
        return real_add(self, layer, hidden, extra, y)

    windows = [list(range(1, 21))]
    import scdviz.evict.student_fit as sf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NormalEquations, "add", spy)
        mp.setattr(sf, "windows", lambda *a, **k: windows)
        normal = accumulate(model, _Words(), cfg, base, False)
    assert normal.decode is not None and normal.xtx.shape[-1] == base.hidden + 5
    ids = torch.tensor(windows)
    with hf.eager(model):
        trace = hf.forward(model, ids[:, :16], capture={"h_in"}, attentions=True)
    col = window_column(trace.attn[1][:, :, -3:], 2)[0]
    prefill = [e for layer, n, e in added if layer == 1 and n == 16][0]
    torch.testing.assert_close(prefill[..., 3], (col + 1e-6).log(), atol=1e-4, rtol=1e-4)
    states = sorted({n for _, n, _ in added if n > 16})
    assert states == [20, 24]  # s = 4, 8 generated tokens
    gen = hf.generate(model, hf.make_cache(model, trace.keys, trace.values), ids[:, 16:17], 16, 9)
    steps = torch.cat([ids[:, 16:17], torch.tensor([gen[:-1]])], 1)  # the greedy generation's inputs
    with hf.eager(model):
        dec = hf.forward(model, steps, cache=hf.make_cache(model, trace.keys, trace.values), attentions=True)
    got = [e for layer, n, e in added if layer == 1 and n == 24][0]
    want = window_column(dec.attn[1][:, :, 5:8, :24].float(), 2)[0]
    torch.testing.assert_close(got[..., 3], (want + 1e-6).log(), atol=1e-4, rtol=1e-4)
