#!/usr/bin/env bash
# run145: the GPU tests after Engine.embed took a lock (threads calling embed at once), with the new GPU test of
# four threads embedding at once, and serve's GPU tests.
cp "$0" "$OUT/command.sh"
timeout 420 bash bench/run_on_gpu.sh "-v --durations=5 tests/test_gpu.py tests/test_serve.py -m gpu"
echo "rc $?" >> "$OUT/tests.log"
