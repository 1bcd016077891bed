"""What calibrate's joint-refinement choice costs per layer at Mistral-7B shapes, the old arithmetic against the new
(issue 58 item 5).

    python -m research.calibrate_cost                   # d_kv 1024 (8 KV heads x 128), 2 folds, one thread
    python -m research.calibrate_cost --d-kv 256 --old-reps 3   # a quick look
    python -m research.calibrate_cost --device cuda     # the same work on the GPU (fp64 there too)

Random joint [K, V] statistics (2 * d_kv dimensions; producer and consumer rows read one hidden state, each
fold a domain with its own offset, ``--rows`` rows per fold: 32 windows of 255 tokens over 2 folds by default)
stand in for one layer's. Rows timed, each for one layer with the default rank and ridge grids of CalibConfig
and REUSE shrinkages (0.1, 0.3): ``choose_joint`` (the leave-one-domain-out errors of every (rank, β), all folds:
the old per-layer ``lodo`` against ``calibrate.joint_lodo``), ``joint_map`` with a rank-64 refinement (what
calibrate fits per refined layer afterwards) and one ``kv_error``. The old arithmetic is the reference kept in
tests/test_rrr_speed.py. New: the median of ``--reps`` runs after a warm-up; old: the median of
``--old-reps`` runs after a warm-up, or a single cold run when ``--old-reps 1`` (the default: at full size a run
takes minutes); old and new runs alternate. Also prints the largest relative difference of the errors, new
against old. Prints a table, writes nothing; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from scdviz.scd import calibrate as cal
from scdviz.scd.calibration import CalibConfig
from tests import test_rrr_speed as ref

ALPHAS = (0.1, 0.3)  # the layer's key and value shrinkages


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(new, old, reps: int, old_reps: int, device: torch.device) -> tuple[list[float], list[float], object, object]:
    """(seconds of each timed run of ``new``, of ``old``, their last results). A warm-up of each that runs more than
    once, then the timed runs interleaved (new, old, new, old, ..., then the rest of the new ones), so a load that
    comes and goes on the machine falls on both alike."""
    seconds: dict = {new: [], old: []}
    out: dict = {}

    def run(fn) -> None:
        _sync(device)
        t0 = time.perf_counter()
        out[fn] = fn()
        _sync(device)
        seconds[fn].append(time.perf_counter() - t0)

    for fn, n in ((new, reps), (old, old_reps)):
        if n > 1:
            out[fn] = fn()
    for i in range(max(reps, old_reps)):
        if i < reps:
            run(new)
        if i < old_reps:
            run(old)
    return seconds[new], seconds[old], out.get(new), out.get(old)


def _cell(seconds: list[float]) -> str:
    med = statistics.median(seconds)
    spread = f" [{min(seconds):.2f}-{max(seconds):.2f}]" if len(seconds) > 1 else " (one cold run)"
    return f"{med:9.2f}{spread}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.calibrate_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--d-kv", type=int, default=1024, help="KV heads x head_dim (default: %(default)s)")
    parser.add_argument("--folds", type=int, default=2, help="domains (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=4080, help="rows per fold (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs of the new arithmetic (default: %(default)s)")
    parser.add_argument("--old-reps", type=int, default=1, help="timed runs of the old one (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="where the statistics live (default: %(default)s)")
    parser.add_argument("--skip-old", action="store_true", help="time the new arithmetic only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = CalibConfig()
    t0 = time.perf_counter()
    stats = ref.random_stats(args.d_kv, [args.rows] * args.folds, n_layers=1, seed=0, device=args.device)
    plain = [[ref.ref_stats(fold[0])] for fold in stats]
    total, plain_total = cal.summed(stats, 0), functools.reduce(ref.ref_add, [fold[0] for fold in plain])
    mu_x, mu_y, b, _ = cal.joint_map(total, cfg.ridge, *ALPHAS, None, 0)
    mu_x, mu_y, b = (t.to(device) for t in (mu_x, mu_y, b))
    print(f"statistics: d_kv {args.d_kv} (joint {2 * args.d_kv}), {args.folds} folds x {args.rows} rows, "
          f"made in {time.perf_counter() - t0:.1f} s; {torch.get_num_threads()} thread(s), {device}; "
          f"ranks {cfg.joint_rank_grid}, ridges {cfg.joint_shrink_grid}", flush=True)
    work = {
        "choose_joint, one layer (all folds)": (lambda: cal.joint_lodo(stats, 0, *ALPHAS, cfg),
                                                lambda: ref.ref_joint_lodo(plain, 0, *ALPHAS, cfg)),
        "joint_map, rank-64 refinement": (lambda: cal.joint_map(total, cfg.ridge, *ALPHAS, 0.1, 64),
                                          lambda: ref.ref_joint_map(plain_total, cfg.ridge, *ALPHAS, 0.1, 64)),
        "kv_error, one map": (lambda: cal.kv_error(stats[0][0], mu_x, mu_y, b),
                              lambda: ref.ref_kv_error(plain[0][0], mu_x, mu_y, b)),
    }
    print(f"\n| per layer ({device}) | old s | new s | old / new | max rel. diff |")
    print("|---|---|---|---|---|")
    for name, (new, old) in work.items():
        new_s, old_s, new_out, old_out = _timed(new, old, args.reps, 0 if args.skip_old else args.old_reps, device)
        if args.skip_old:
            print(f"| {name} | - | {_cell(new_s)} | - | - |", flush=True)
            continue
        if isinstance(new_out, dict):
            diff = max(abs(new_out[k] - old_out[k]) / abs(old_out[k]) for k in old_out)
        elif isinstance(new_out, float):
            diff = abs(new_out - old_out) / abs(old_out)
        else:  # joint_map: the whole map (its refinement is stored in float32)
            diff = float((new_out[2] - old_out[2].to(new_out[2].device)).abs().max() / old_out[2].abs().max())
        ratio = statistics.median(old_s) / statistics.median(new_s)
        print(f"| {name} | {_cell(old_s)} | {_cell(new_s)} | {ratio:5.1f}x | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
