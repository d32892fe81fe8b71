#!/usr/bin/env bash
# run155: the small-batch kernel with weights read into registers before each barrier, attention with lanes over keys,
# and block 0's timeline of each phase and barrier; kernel and step latency against the per-operation path (495305c).
set -u
out=${OUT:-bench-out}
cp .ab/exp155.sh "$out/command.sh"; cp .ab/micro155.py "$out/"
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/minilm PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$out/machine.txt"
timeout 200 python3 .ab/micro155.py "$out" 2>&1 | grep -v Warn | tail -40
timeout 220 python3 -m bench.step_latency --minilm .bundle/minilm --models minilm,bert-base --arms small=.,before=.ab/495305c \
  --rounds 2 --repeats 200 --out "$out/step_latency" 2>&1 | tail -22
