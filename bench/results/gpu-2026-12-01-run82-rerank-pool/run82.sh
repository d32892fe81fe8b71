#!/usr/bin/env bash
# run82: rerank with the pairs tokenized in worker processes: a timeline (in process / 4 / 8 workers), then bench.gpu_rerank.
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export PYTHONPATH=/tmp/site:$PWD EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz PYTHONUNBUFFERED=1
{ date -u; git rev-parse --short HEAD; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } | tee "$OUT/machine.txt"
python3 .ab/rerank_timeline.py "$OUT/timeline" 2>&1 | grep -v Warning | cut -c1-1500
python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 50 --out "$OUT/gpu_rerank" 2>&1 | grep -v Warning | tail -9
