# run139: the non-kernel time of a step taken apart (.ab/split139.py): Qwen3-0.6B 1 x 4,096 and the BERT-base
# cross-encoder 5 x 512 (also through Triton attention), as they are and with cuBLAS without a workspace.
set -u
out=${OUT:-bench-out}
cp .ab/exp139.sh "$out/command.sh"; cp .ab/split139.py "$out/"
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export PYTHONPATH=/tmp/site:$PWD EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz PYTHONUNBUFFERED=1
{ date -u; cat COMMIT 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$out/machine.txt"
python3 .ab/split139.py "$out" 2>&1 | tail -40 | tee "$out/bench.log"
