#!/usr/bin/env bash
# run144: the GPU tests of serve, index and score after this session's host-side changes (TEI routes ignore
# unknown fields, GET / and /docs open, the forced quit's lifespan; index's blank duplicates and rebuild counts).
cp "$0" "$OUT/command.sh"
timeout 400 bash bench/run_on_gpu.sh "-v -m gpu tests/test_gpu.py tests/test_serve.py -k 'index or score or serve or server'"
echo "rc $?" >> "$OUT/tests.log"
