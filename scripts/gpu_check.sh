#!/usr/bin/env bash
# The GPU check: device facts, the float32 parity tests and the bench at S, M and L, one JSON
# line per result on stdout, progress on stderr; under 8 minutes on one GPU. What the lines
# mean: docs/gpu.md. The work is done by scripts/gpu_check.py; every flag is passed to it
# (--help lists them).
#
#   bash scripts/gpu_check.sh               # on a GPU; refuses (exit 2, one line) without one
#   bash scripts/gpu_check.sh --smoke       # tiny config, one parity test, on the CPU: < 60 s
#   bash scripts/gpu_check.sh --allow-cpu --configs S   # the full stages without a GPU
#
# Exit status: 0 when every stage passed, 1 when one failed (the others still run), 2 without
# a GPU (or when jax cannot start), argparse's 2 for a bad flag.
#
# Where $OUT is set (a lent machine's folder of files that come back), the lines are also
# written to $OUT/gpu_check.jsonl, the bench's whole rows to $OUT/gpu_check_raw.jsonl and
# pytest's output to $OUT/gpu_check_pytest.log; --out PATH writes them elsewhere.
#
# On a lent machine with no network, a few minutes of device time:
#
# 1. Look first at what it has: `python3 -c 'import jax; print(jax.devices())'` and
#    `python3 -m pip list | grep -i -e jax -e nvidia -e equinox -e optax -e jaxtyping`. A
#    machine whose jax already has its CUDA plugin (the H200 image this project has been lent
#    has jax with jax-cuda13-plugin and jax-cuda13-pjrt, equinox, optax, jaxtyping and
#    pytest) needs nothing carried: fusedpc itself runs from this checkout's src/ (this script
#    puts it on PYTHONPATH).
# 2. Otherwise carry jax's CUDA 12 plugin as wheels, fetched where pip reaches PyPI, for the
#    lent machine's python (3.12 here; match `python3 --version` there) and jax's version
#    (the plugin's version equals jaxlib's; 0.10.2 below). The `with-cuda` extra brings the
#    nvidia-* wheels (cuBLAS, cuDNN, cuFFT, cuSOLVER, cuSPARSE, NCCL, nvJitLink, the CUDA
#    runtime, CUPTI, nvcc), well over 1 GB together: only a machine whose transfer limit
#    allows that can take them.
#
#      python3 -m pip download --dest .whl --only-binary=:all: --implementation cp \
#        --python-version 3.12 --platform manylinux_2_28_x86_64 \
#        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#        --platform manylinux2014_x86_64 \
#        "jax-cuda12-plugin[with-cuda]==0.10.2" "jax-cuda12-pjrt==0.10.2" \
#        "jax==0.10.2" "jaxlib==0.10.2"
#
#    and there, before the check:
#
#      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#      export PYTHONPATH=/tmp/site
#
# 3. Run the check once, with its output kept (PYTHONUNBUFFERED so that a cut run still
#    shows how far it came):
#
#      PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh 2>&1 | tee "${OUT:-.}/gpu_check.log"
#
# PYTHON names the interpreter (default python3).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/gpu_check.py" "$@"
