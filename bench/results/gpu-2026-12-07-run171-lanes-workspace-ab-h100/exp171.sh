#!/usr/bin/env bash
# run171 (carry .bundle/site.tar.xz, .bundle/tokgz, .bench-data, .ab, COMMIT): bench.throughput_ab, BERT-base
# (random weights, mean pooling) model-only on the 10,000 docstrings, varlen, three lanes: HEAD against b25fad4
# (run42's 2.87M), 313c2cd (b25fad4 + each lane capturing on its own stream), HEAD capturing each lane on a
# capture stream of its own apart from its replay stream (.ab/capstream), HEAD on one lane, HEAD with gc.freeze.
set -u
out=${OUT:-bench-out}
mkdir -p "$out"
cp .ab/exp171.sh "$out/"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/machine.txt"
timeout 540 python3 -m bench.throughput_ab --minilm .bundle/tokgz --corpus .bench-data/docstrings.parquet \
  --arms new=.,b25fad4=.ab/b25fad4,313c2cd=.ab/313c2cd,capture-stream=.ab/capstream,new-one-lane=.@lanes=1,new-frozen=.@freeze --rounds 2 \
  --out "$out/throughput_ab" 2>&1 | tee "$out/throughput_ab.log"
echo "rc $? at ${SECONDS}s" | tee -a "$out/throughput_ab.log"
