#!/usr/bin/env bash
# run152: the cross-encoder through FlashInfer after its sigmoid moved out of the graph (Engine.activate, 72dded9):
# run151 covered varlen and Triton; this is the FlashInfer arm of the same test.
set -u
out=${OUT:-bench-out}
cp .ab/exp152.sh "$out/command.sh"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
timeout 420 bench/run_on_gpu.sh "-v -m gpu tests/test_gpu.py -k 'cross_encoder_on_the_gpu and flashinfer'"
echo "rc $?" >> "$out/tests.log"
