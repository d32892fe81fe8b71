#!/usr/bin/env bash
# run154: engine/small_batch.cu, a whole BERT in one persistent kernel for batches of at most 64 tokens: correctness and
# kernel time against the per-operation path (micro154.py), batch-1 step latency against 495305c (separate processes,
# alternating), then test_gpu.py (real MiniLM against sentence-transformers, eager / capture / replay) with it on.
set -u
out=${OUT:-bench-out}
cp .ab/exp154.sh "$out/command.sh"; cp .ab/micro154.py "$out/"
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/minilm PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$out/machine.txt"
timeout 200 python3 .ab/micro154.py "$out" 2>&1 | grep -v Warn | tail -40
timeout 220 python3 -m bench.step_latency --minilm .bundle/minilm --models minilm,bert-base --arms small=.,before=.ab/495305c \
  --rounds 2 --repeats 200 --profile --out "$out/step_latency" 2>&1 | tail -22
timeout 150 python3 -m pytest -p no:cacheprovider -q -x -m gpu tests/test_gpu.py 2>&1 | tail -15 | tee "$out/tests.log"
