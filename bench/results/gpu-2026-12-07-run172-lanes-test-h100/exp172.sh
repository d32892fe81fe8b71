#!/usr/bin/env bash
# run172 (carry .bundle/site.tar.xz, .bundle/tokgz, .bench-data, .ab, COMMIT): the new lanes test
# (test_lanes_replaying_full_batches_at_once_give_one_lanes_vectors) on this tree with BERT-base's GPU tests, then
# the same test against b25fad4's engine (expected to fail: its lanes shared one cuBLAS workspace) and 313c2cd's
# (expected to pass), then bench.step_latency on this tree (its GPU path since bench.common's shared A/B plumbing).
set -u
out=${OUT:-bench-out}
mkdir -p "$out"
cp .ab/exp172.sh .ab/old_engine_test.py "$out/"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/machine.txt"
timeout 240 python3 -m pytest -p no:cacheprovider -q -ra tests/test_gpu.py -k "replaying or (bert_base_shape and (varlen or triton))" 2>&1 | tail -30 | tee "$out/tests.log"
echo "pytest rc ${PIPESTATUS[0]} at ${SECONDS}s" | tee -a "$out/tests.log"
for c in b25fad4 313c2cd; do
  timeout 120 python3 .ab/old_engine_test.py .ab/$c /tmp/old-$c 2>&1 | tail -25 | tee "$out/old-$c.log"
  echo "$c rc ${PIPESTATUS[0]} at ${SECONDS}s" | tee -a "$out/old-$c.log"
done
timeout $((420 - SECONDS)) python3 -m bench.step_latency --minilm .bundle/tokgz --models bert-base --arms new=. --rounds 1 \
  --repeats 100 --out "$out/step_latency" 2>&1 | tail -20 | tee "$out/step_latency.log"
echo "step_latency rc ${PIPESTATUS[0]} at ${SECONDS}s" | tee -a "$out/step_latency.log"
