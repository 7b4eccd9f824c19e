#!/usr/bin/env bash
# The GPU measurements, in parts that each fit a 10-minute call on a lent GPU machine (its own
# python3 holds a CUDA torch; nothing can be installed from the network there):
#
#   bash benchmarks/gpu.sh tests        # the tests marked gpu
#   bash benchmarks/gpu.sh per-sample   # per-sample + variance-of-gradients suites, large size
#   bash benchmarks/gpu.sh rest         # in-backward, side-losses, distributed
#
# Competitors that are not installed there travel as wheels in .whl/ (git-ignored; name it in
# the call's carry), fetched beforehand on a machine with pip:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl backpack-for-pytorch==1.7.1 unfoldNd opacus==1.6.0
# Results (JSON, PNG, logs) go to $OUT when set, else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
bench() { python3 -m leanprop.bench.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

case "${1:-}" in
tests)
    python3 -m pytest -q -p no:cacheprovider -m gpu 2>&1 | tee "$out/gpu_tests.log"
    ;;
per-sample)
    bench per-sample variance-of-gradients --device cuda --size large \
        --json "$out/bench_cuda_per_sample.json" --plot "$out/bench_cuda_per_sample.png" \
        2>&1 | tee "$out/bench_cuda_per_sample.log"
    ;;
rest)
    bench in-backward side-losses distributed --device cuda --size large \
        --json "$out/bench_cuda_rest.json" 2>&1 | tee "$out/bench_cuda_rest.log"
    ;;
*)
    echo "usage: bash benchmarks/gpu.sh tests|per-sample|rest" >&2
    exit 2
    ;;
esac
