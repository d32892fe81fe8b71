#!/usr/bin/env bash
# run163: the GPU tests on this session's code (serve freezes its start-up objects before listening, /tokenize
# counts long requests in pieces first; readers cast same-kind Parquet columns to an output's types; --table
# NAME.lance refused; the metrics line at --top-k below 10; Lance rows_committed without restamps; OpenAI error types), test_gpu.py in full for the first time since run160 (issue 4's suites: run164).
# engine/ is unchanged since run160.
set -u
out=${OUT:-bench-out}
cp .ab/exp163.sh "$out/command.sh"
timeout 400 bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_serve.py"
