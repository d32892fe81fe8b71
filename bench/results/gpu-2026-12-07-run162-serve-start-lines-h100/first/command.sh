#!/usr/bin/env bash
# run162: the GPU tests on this session's code (serve sets up uvicorn's logging before the model loads, so its
# "held; loading" line and the CUDA warm-up line show, and a new test starts `embedctl serve --device cuda`;
# restamped rows upserted whole into Lance; Parquet restamp dictionaries; the bar's token rate). engine/ is
# unchanged since run160.
set -u
out=${OUT:-bench-out}
cp .ab/exp162.sh "$out/command.sh"
timeout 200 bench/run_on_gpu.sh "-m gpu tests/test_serve.py"
