#!/usr/bin/env bash
# run159: the GPU tests on the session's last commits (serve counts an abandoned small request as 499 from uvicorn's
# request cycle; the API refuses a cross-encoder's embed(); queries and documents no longer fall back to the default
# prompt), the real MiniLM carried.
set -u
out=${OUT:-bench-out}
cp .ab/exp159.sh "$out/command.sh"
timeout 420 bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_serve.py"
