#!/usr/bin/env bash
# run153: one causal sequence's attention: cuDNN (torch SDPA) against FlashInfer's fa3 and the rest, kernel by kernel
# (micro153.py), then Qwen3-0.6B batch 1 with graphs of one causal sequence through cuDNN (working tree) against
# 495305c (FlashInfer for them), in processes of their own, with a profiled step each.
set -u
out=${OUT:-bench-out}
cp .ab/exp153.sh "$out/command.sh"; cp .ab/micro153.py "$out/"
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
gunzip -kf .bundle/tokgz/tokenizer.json.gz
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$out/machine.txt"
timeout 240 python3 .ab/micro153.py "$out" 2>&1 | grep -v Warn | tail -40
timeout 300 python3 -m bench.step_latency --minilm .bundle/tokgz --models qwen3-0.6b --arms cudnn=.,before=.ab/495305c \
  --rounds 2 --repeats 100 --profile --out "$out/step_latency" 2>&1 | tail -30
