#!/usr/bin/env bash
# Fetch, here, the wheels the GPU machine lacks for research/gpu_check.py (kvpress and what it
# imports; fire 0.7.1: 0.6 has no wheel), for its Python 3.12, into .whl/ (ignored by git; carried with `carry: [".whl"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  kvpress==0.5.5 cachetools==5.5.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fire==0.7.1 termcolor==3.3.0
ls -la .whl
