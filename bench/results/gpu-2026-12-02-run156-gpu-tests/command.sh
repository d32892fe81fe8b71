#!/usr/bin/env bash
# run156: the GPU tests on this session's final code (no engine/ change; score now passes --attention, --eager,
# --no-compile, --max-seqs and --lanes to its engines; serve's request layer: /embed mixed inputs, API key strip).
set -u
out=${OUT:-bench-out}
cp .ab/exp156.sh "$out/command.sh"
timeout 420 bench/run_on_gpu.sh "tests/test_gpu.py tests/test_serve.py -m gpu"
