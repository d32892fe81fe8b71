#!/usr/bin/env bash
# run146: the GPU tests after Engine.embed stopped checking ids twice (embed checks only where step() does not).
cp "$0" "$OUT/command.sh"
timeout 300 bash bench/run_on_gpu.sh "-v -m gpu tests/test_gpu.py tests/test_serve.py -k 'embed or matryoshka or graph_replay or minilm or index or score or server or scheduler'"
echo "rc $?" >> "$OUT/tests.log"
