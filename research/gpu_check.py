"""The prepared GPU check: both methods' bf16 and wrong-device invariants on CUDA, as a JSON report.

Runs ``tests/test_device.py`` (every SCD plan and every eviction path on tiny random models:
under a wrong-device trap and in bfloat16) with the models on the GPU
(``SCDVIZ_TEST_DEVICE=cuda``), then the thread-isolation tests, and writes one JSON report:
versions, the GPU, each test's outcome and seconds, and peak GPU memory; then (``--timing``) SCD's
consumer-side work against the oracle's prefill at the layer shapes of Mistral-7B and a 32B-class
model with random bf16 weights, 1k and 4k-token prompts (scdviz.scd.scale). Needs no network and
no model download; on the lent H200 machine the tests take about a minute (the timing part has not
run on a GPU yet).

On the device machine (it lacks kvpress and its imports; carry them, see research/gpu_wheels.sh):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 -m research.gpu_check --out $OUT/gpu_check.json

Exit status 0 when every test passed, 1 otherwise; 2 when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_device.py", "tests/test_concurrency.py"]


class _Collect:
    """A pytest plugin keeping each test's outcome and duration."""

    def __init__(self):
        self.rows: list[dict] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.rows.append({"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 3),
                              "message": str(report.longrepr)[-2000:] if report.failed else ""})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON report (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="torch device for the tiny models (default: %(default)s)")
    parser.add_argument("--timing", default="Mistral-7B,Qwen-32B",
                        help="model shapes to time SCD's consumer side at, random bf16 weights (scdviz.scd.scale), "
                             "comma-separated; empty: none (default: %(default)s)")
    args = parser.parse_args(argv)
    import pytest
    import torch
    import transformers

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device is visible; nothing checked", file=sys.stderr)
        return 2
    os.environ["SCDVIZ_TEST_DEVICE"] = args.device
    os.chdir(REPO)
    collect = _Collect()
    t0 = time.perf_counter()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *TESTS], plugins=[collect])
    report = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "cuda": torch.version.cuda},
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if args.device.startswith("cuda") else None,
        "passed": sum(r["outcome"] == "passed" for r in collect.rows),
        "failed": sum(r["outcome"] == "failed" for r in collect.rows),
        "tests": collect.rows,
    }
    if args.timing:
        from scdviz.scd import scale

        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        report["timing"] = [row for shape in args.timing.split(",") if shape
                            for row in scale.Timing(shape.strip(), device=args.device, dtype=dtype).rows()]
        for row in report["timing"]:
            print(f"{row['model']:10s} {row['tokens']:5d} tokens: oracle prefill {row['oracle_prefill_ms']:9.1f} ms, "
                  f"SCD consumer {row['scd_consumer_ms']:8.1f} ms (parse on CPU {row['parse_cpu_ms']:.1f}), "
                  f"TTFT at 10 Gbit/s {row['scd_ttft_10gbps_ms']:8.1f} ms, speed-up {row['speedup_10gbps']:.2f}x")
        report["peak_gpu_mib"] = (round(torch.cuda.max_memory_allocated() / 2**20, 1)
                                  if args.device.startswith("cuda") else None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "tests"}, indent=1))
    for row in collect.rows:
        print(f"{row['outcome']:7s} {row['seconds']:7.2f} s  {row['test']}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
