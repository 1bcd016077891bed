"""Host memory at Mistral-7B layer shapes, per layer (issue 58, item 5): the distilled scorer's fit and Codec.encode.

    python -m research.host_memory [--what fit codec] [--layers 1 2 3] [--contexts 1] [--tokens 2048]

Each point runs in a fresh subprocess (one thread; glibc told to hand every block of 64 KiB or more back to
the OS when it is freed, so RSS follows what is allocated) on a random-weight Llama at Mistral-7B's layer
shapes (width 4096, 32 query and 8 KV heads of 128, FFN 14336; ``hf.random_llama``) with 1, 2, 3 layers. The
number is the peak RSS above what the process held once the model was built (its weights, torch itself):
VmHWM, reset through /proc/self/clear_refs, less VmRSS then, per phase (VmHWM is reset at each phase's start,
so each phase's peak is its own). A line fixed + per-layer x L through each phase's points gives it at 32
layers, and the largest phase there is the footprint (at 1-3 layers a phase whose fixed part is large, like a
forward pass, can peak highest and still be passed at 32 by one that grows faster per layer). Everything runs
on the CPU, so the producer's own forward (its cache, its captures) is host memory here; on a GPU it is not.
Prints tables, writes nothing. Run it in the tree to measure (before / after a change: the same command in
each checkout).

fit: ``student_fit.accumulate`` with the shipped student's recipe (its fit log: per KV head, window 32, decode
states, the listwise stage's lists spooled to disk), on ``--contexts`` training contexts instead of the recipe's
120 (the normal equations do not grow with them; the spool does, on disk; one layer of it read back does, in
memory: the table scales that to the recipe's count), then the recipe's solves, then one layer of the listwise
stage. The model is float32 there (4x faster on a CPU than bfloat16; the
fit's normal equations and lists do not depend on it).

codec: ``Codec.encode`` of one ``--tokens`` prefix, bfloat16 producer (vocabulary 32,000), in two phases: the
producer's forward (``hf.forward``), then the rest (moving, coding and serialising), for raw fp16 K/V,
KIVI 4-bit K/V with a 128-token fp16 window, and SCD reuse-only (REUSE codes of rank 64 at 4 bits on every
layer; random codes: the bytes do not depend on their values).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MISTRAL = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336)
CODEC_PLANS = ("raw fp16", "KIVI 4-bit", "SCD reuse-only 4-bit")
MB = 1e6


def _status(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak(collect: bool = True) -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0); returns that RSS."""
    import gc

    if collect:
        gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


class _Words:
    """Word ids mod ``vocab``: text for a random model."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [sum(map(ord, w)) % self.vocab for w in text.split()]}


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors an object holds in its attributes (lists and dicts of them included), sub-objects
    of the same kind included (the decode states' normal equations)."""
    import torch

    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.nbytes
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if hasattr(x, "__dict__") and type(x).__module__.startswith("scdviz"):
            return sum(walk(v) for v in vars(x).values())
        return 0

    return walk(obj)


def _child_fit(layers: int, contexts: int) -> dict:
    import torch

    from scdviz import config
    from scdviz.evict import student_fit as sf
    from scdviz.evict.student import Student
    from scdviz.models import hf

    recipe, _ = config.from_dict(sf.FitConfig, Student.shipped().log["config"])
    cfg = dataclasses.replace(recipe, contexts=contexts)
    vocab = 1024
    model = hf.random_llama(layers=layers, vocab=vocab, dtype=torch.float32, **MISTRAL)
    student = Student.for_model(model, cfg.student)
    spool = tempfile.TemporaryDirectory(prefix="listwise-spool-")
    base = _reset_peak()
    lists = sf.Lists(spool.name, layers) if cfg.listwise else None
    normal = sf.accumulate(model, _Words(vocab), cfg, student, False, lists)
    out = {"accumulate": _status("VmHWM") - base, "normal_bytes": _tensor_bytes(normal),
           "spool_bytes": sum(f.stat().st_size for f in Path(spool.name).iterdir())}
    if lists:  # one layer as the listwise stage reads it: float32 inputs, float32 lists (grows with the contexts)
        h, by_now = lists.layer(0)
        out["listwise_input_bytes"] = h.nbytes + sum(e.nbytes + t.nbytes for e, t in by_now.values())
        del h, by_now
    weights = None
    _reset_peak()
    for ridge in cfg.ridges:
        for weight in cfg.decode_weights if normal.decode is not None else (1.0,):
            weights = normal.solve(float(ridge), float(weight))
    out["solve"] = _status("VmHWM") - base
    _reset_peak()
    if lists:
        sf.listwise_layer(lists, 0, weights[0], float(cfg.listwise[0]), float(cfg.decode_weights[0]),
                          cfg.listwise_iters)
    out["listwise"] = _status("VmHWM") - base
    out["recipe_contexts"] = recipe.contexts
    spool.cleanup()
    return out


def _child_codec(layers: int, tokens: int, plan_name: str) -> dict:
    from types import SimpleNamespace

    import torch

    from scdviz.models import hf
    from scdviz.scd import plan as plans
    from scdviz.scd.codec import Codec
    from scdviz.scd.rrr import LinearCode

    model = hf.random_llama(layers=layers, vocab=32000, dtype=torch.bfloat16, **MISTRAL)
    ids = torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))
    if plan_name == "raw fp16":
        codec = Codec.raw(layers)
    elif plan_name == "KIVI 4-bit":
        codec = Codec(plans.raw_plan(layers, bits=4, window=128))
    else:  # REUSE codes of rank 64 on every layer: a stand-in calibration holding only what encode reads
        g, d_kv, rank = torch.Generator().manual_seed(1), MISTRAL["kv_heads"] * MISTRAL["head_dim"], 64

        def code():
            return LinearCode(torch.zeros(d_kv), torch.zeros(d_kv), torch.randn(d_kv, rank, generator=g) / 32,
                              torch.randn(rank, d_kv, generator=g), torch.ones(rank), torch.zeros(rank + 1))

        calib = SimpleNamespace(n_layers=layers, tag=1, key_codes=[code() for _ in range(layers)],
                                value_codes=[code() for _ in range(layers)])
        codec = Codec(plans.scd_plan([rank] * layers, [rank] * layers, code_bits=4), calib)
    peaks, forward = {}, hf.forward

    def phased(*args, **kwargs):  # the forward's peak, then the rest's from there
        out = forward(*args, **kwargs)
        peaks["forward"] = _status("VmHWM")
        _reset_peak(collect=False)
        return out

    hf.forward = phased  # encode (and transfer.producer_state, before issue 58) call it through the module
    base = _reset_peak()
    blob = codec.encode(model, ids)
    return {"forward": peaks["forward"] - base, "after forward": _status("VmHWM") - base, "payload": len(blob)}


def _run_child(args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               SCDVIZ_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "research.host_memory", "--child", *args], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(fixed, per layer): the least-squares line through the points (exact through two)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


FIT_PHASES = ("accumulate", "solve", "listwise")
CODEC_PHASES = ("forward", "after forward")


def _at_32(layers: list[int], points: list[dict], phases: tuple[str, ...]) -> tuple[dict, str]:
    """Per phase its line (fixed, per layer) through the points, and the phase largest at 32 layers."""
    lines = {p: _line(layers, [r[p] for r in points]) for p in phases}
    return lines, max(phases, key=lambda p: lines[p][0] + 32 * lines[p][1])


def _fit_table(layers: list[int], contexts: int) -> None:
    points = [_run_child(["fit", str(n), str(contexts)]) for n in layers]
    recipe = points[0]["recipe_contexts"]
    print(f"\nfit_student, the shipped recipe on {contexts} training context{'s' * (contexts > 1)}: peak RSS above the "
          "built model per phase, MB (accumulate: the training contexts into the normal equations, the listwise "
          "stage's lists spooled to disk; solve: the recipe's ridge solves; listwise: one layer of the listwise "
          "stage, read back from the spool)")
    print("| layers | accumulate | solve | listwise | normal equations held | spool on disk |")
    print("|---|---|---|---|---|---|")
    for n, r in zip(layers, points):
        print(f"| {n} | {r['accumulate'] / MB:,.0f} | {r['solve'] / MB:,.0f} | {r['listwise'] / MB:,.0f} | "
              f"{r['normal_bytes'] / MB:,.0f} | {r['spool_bytes'] / MB:,.1f} |")
    if len(layers) < 2:
        return
    lines, top = _at_32(layers, points, FIT_PHASES)
    print("\n" + "; ".join(f"{p}: {a / MB:,.0f} + {b / MB:,.0f} x L MB" for p, (a, b) in lines.items()))
    fixed, per = lines[top]
    print(f"32 layers on {contexts} context{'s' * (contexts > 1)}: {(fixed + 32 * per) / 1e9:.1f} GB ({top})")
    spool_per = sum(r["spool_bytes"] / n for n, r in zip(layers, points)) / len(layers) / contexts
    listwise_per = sum(r["listwise_input_bytes"] for r in points) / len(layers) / contexts
    more = recipe - contexts
    # host memory grows with the contexts only where the listwise stage reads one layer of all of them back
    grown = {p: (a + (more * listwise_per if p == "listwise" else 0), b) for p, (a, b) in lines.items()}
    top = max(grown, key=lambda p: grown[p][0] + 32 * grown[p][1])
    fixed, per = grown[top]
    print(f"on the recipe's {recipe} contexts: one layer of the lists read back takes {listwise_per / MB:.1f} MB per "
          f"context more ({recipe * listwise_per / 1e9:.2f} GB), host memory at 32 layers "
          f"{(fixed + 32 * per) / 1e9:.1f} GB ({top}); the spool holds {spool_per / MB:.2f} MB per layer and "
          f"context on disk, {32 * recipe * spool_per / 1e9:.1f} GB at 32 layers, deleted when the fit ends")


def _codec_table(layers: list[int], tokens: int) -> None:
    print(f"\nCodec.encode of a {tokens}-token prefix, bfloat16 producer on the CPU: peak RSS above the built model "
          "per phase, MB (the producer's forward / the rest), payload MB")
    print("| plan | " + " | ".join(f"{n} layer{'s' * (n > 1)}" for n in layers)
          + " | forward | after forward | 32 layers | 32 layers, payload |")
    print("|---|" + "---|" * (len(layers) + 4))
    for plan in CODEC_PLANS:
        points = [_run_child(["codec", str(n), str(tokens), plan]) for n in layers]
        cells = [f"{r['forward'] / MB:,.0f} / {r['after forward'] / MB:,.0f} ({r['payload'] / MB:.1f})"
                 for r in points]
        if len(layers) < 2:
            print(f"| {plan} | " + " | ".join(cells) + " | - | - | - | - |")
            continue
        lines, top = _at_32(layers, points, CODEC_PHASES)
        fixed, per = lines[top]
        _, pay = _line(layers, [r["payload"] for r in points])
        print(f"| {plan} | " + " | ".join(cells) + " | "
              + " | ".join(f"{a / MB:,.0f} + {b / MB:,.1f} L" for a, b in lines.values())
              + f" | {(fixed + 32 * per) / 1e9:.2f} GB ({top}) | {32 * pay / 1e9:.2f} GB |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        what, *rest = sys.argv[2:]
        if what == "fit":
            out = _child_fit(int(rest[0]), int(rest[1]))
        else:
            out = _child_codec(int(rest[0]), int(rest[1]), rest[2])
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", nargs="+", choices=("fit", "codec"), default=["fit", "codec"])
    ap.add_argument("--layers", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--contexts", type=int, default=1, help="fit: training contexts (the recipe has 120)")
    ap.add_argument("--tokens", type=int, default=2048, help="codec: prefix tokens")
    args = ap.parse_args()
    if "fit" in args.what:
        _fit_table(args.layers, args.contexts)
    if "codec" in args.what:
        _codec_table(args.layers, args.tokens)


if __name__ == "__main__":
    main()
