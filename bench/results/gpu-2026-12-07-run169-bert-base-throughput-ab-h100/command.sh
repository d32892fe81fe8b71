#!/usr/bin/env bash
# run169 (carry .bundle/site.tar.xz, .bundle/tokgz, .bench-data, .ab, COMMIT; nvidia-h200): BERT-base's model-only
# throughput: HEAD's engine against b25fad4's (run42's 2.87M) on the same ids and GPU (tput169.py), then
# bench.gpu_engine's throughput and profile per attention backend on HEAD.
set -u
out=${OUT:-bench-out}
mkdir -p "$out"
cp .ab/exp169.sh .ab/tput169.py "$out/"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | grep -v shards | tail -2
import pathlib, shutil, torch, transformers
source, model = pathlib.Path(".bundle/tokgz"), pathlib.Path("/tmp/minilm-random")
shutil.copytree(source, model, dirs_exist_ok=True)
torch.manual_seed(0)
transformers.BertModel(transformers.BertConfig.from_pretrained(model)).save_pretrained(model)
print("random MiniLM in", model)
PY
export EMBEDCTL_TEST_MODEL=/tmp/minilm-random
python3 -c "from pathlib import Path; from bench.common import random_bert_base; print(random_bert_base(Path('/tmp/bert-base')))" 2>&1 | grep -v shards
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/machine.txt"
timeout 450 python3 .ab/tput169.py .bench-data/docstrings.parquet /tmp/bert-base "$out/ab" 2>&1 | tee "$out/ab.log"
echo "ab rc $? at ${SECONDS}s" | tee -a "$out/ab.log"
timeout $((590 - SECONDS)) bench/run_on_gpu.sh "--version" "bench.gpu_engine --minilm /tmp/minilm-random --corpus .bench-data/docstrings.parquet --docs 10000 --models bert-base --suites throughput,profile --attention triton,flashinfer --no-peers"
echo "bench rc $? at ${SECONDS}s" >> "$out/bench.log"
rm -f "$out/ab/ids.npz"
