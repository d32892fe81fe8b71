#!/usr/bin/env bash
# run141: the GPU tests on f59f46b (engine: check_ids in embed and step, the load check's pair template,
# ModelSpec.vocab_size; score's float64 cosines and its new GPU test), MiniLM and the serving wheels carried.
cp "$0" "$OUT/command.sh"
timeout 400 bash bench/run_on_gpu.sh "-v --durations=15 tests/test_gpu.py tests/test_serve.py -m gpu tests/test_qwen3.py"
echo "rc $?" >> "$OUT/tests.log"
