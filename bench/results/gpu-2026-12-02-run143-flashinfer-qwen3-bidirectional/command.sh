#!/usr/bin/env bash
# run143: the FlashInfer test that run142's time limit cut off while FlashInfer compiled its non-causal module
# (the bidirectional Qwen3-0.6B shape through FlashInfer against transformers fp32), on its own.
set -u
out=${OUT:-bench-out}
cp .ab/exp143.sh "$out/command.sh"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
timeout 500 bench/run_on_gpu.sh "-v -m gpu tests/test_qwen3.py -k 'flashinfer and False-mean'"
echo "rc $?" >> "$out/tests.log"
