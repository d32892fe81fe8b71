# run138: a kernel-by-kernel profile of the two nearest misses on HEAD's engine, FlashInfer carried: Qwen3-0.6B's
# shape at one 4,096-token input (issue 7) and BERT-base's cross-encoder shape at 5 pairs of 512 tokens (issue 5).
set -u
out=${OUT:-bench-out}
cp .ab/exp138.sh "$out/command.sh"; cp .ab/profile138.py "$out/"
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export PYTHONPATH=/tmp/site:$PWD EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz PYTHONUNBUFFERED=1
{ date -u; cat COMMIT 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$out/machine.txt"
python3 .ab/profile138.py "$out" 2>&1 | tail -90 | tee "$out/bench.log"
