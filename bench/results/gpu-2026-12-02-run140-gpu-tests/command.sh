#!/usr/bin/env bash
# run140: the GPU tests on 82ed1c0 (engine: the vocab check in step, the files' hash), MiniLM and the serving wheels carried.
cp "$0" "$OUT/command.sh"
timeout 215 bash bench/run_on_gpu.sh "-v --durations=15 tests/test_gpu.py tests/test_serve.py -m gpu tests/test_qwen3.py"
echo "rc $?" >> "$OUT/tests.log"
