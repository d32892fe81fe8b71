#!/usr/bin/env bash
# run167, in one call (failed starts had left too little device time for two): every GPU test on db05ca7 with FlashInfer
# installed, in 6 pytest-xdist processes so that FlashInfer's JIT modules compile side by side (one after another they
# took 330-470 s: run142/run143). MiniLM's files are carried without their weights (the carry limit holds FlashInfer or
# the weights, not both): a random-weight MiniLM is built from its config here, so the tests against
# sentence-transformers compare the same random weights. FlashInfer's set last ran in run152 (ef1493e), test_qwen3.py in
# run142/143, test_serve.py's GPU tests in run163 (045ba1d; serve embeds whitespace-only text since db05ca7).
# Then BERT-base's throughput through auto with FlashInfer (issue 3's 2.8M / 2.2M: last 2.45-2.58M model-only in
# run115/run122, 2.87-3.02M in run42/run43), and, time allowing, an A/B of the tokenizer workers' spin on the 4 x 100
# suite (SPIN_SECONDS 0.02 as is, against 0).
set -u
out=${OUT:-bench-out}
cp .ab/exp167.sh "$out/command.sh"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
python3 - <<'PY' 2>&1 | tail -3
import pathlib, shutil, torch, transformers
source, model = pathlib.Path(".bundle/tokgz"), pathlib.Path("/tmp/minilm-random")
shutil.copytree(source, model, dirs_exist_ok=True)
torch.manual_seed(0)
transformers.BertModel(transformers.BertConfig.from_pretrained(model)).save_pretrained(model)
print("random MiniLM in", model, sorted(p.name for p in model.iterdir()))
PY
export EMBEDCTL_TEST_MODEL=/tmp/minilm-random
timeout 360 bench/run_on_gpu.sh "-v -n 6 -m gpu tests/test_gpu.py tests/test_qwen3.py tests/test_serve.py"
echo "tests rc $? at ${SECONDS}s" >> "$out/tests.log"
export PYTHONPATH=/tmp/site  # run_on_gpu.sh put flashinfer and the serving wheels there
echo "== bench.gpu_engine bert-base throughput at ${SECONDS}s" | tee -a "$out/bench.log"
timeout $((540 - SECONDS)) python3 -m bench.gpu_engine --minilm /tmp/minilm-random --corpus .bench-data/docstrings.parquet \
  --docs 10000 --models bert-base --suites throughput --no-peers --out "$out/gpu_engine" 2>&1 | tail -25 | tee -a "$out/bench.log"
echo "bench rc ${PIPESTATUS[0]} at ${SECONDS}s" >> "$out/bench.log"
root=$PWD
mkdir -p /tmp/spin0 && cp -r embedctl engine pipelines bench tests sample_data pyproject.toml /tmp/spin0 \
  && sed -i 's/^SPIN_SECONDS = 0.02$/SPIN_SECONDS = 0.0/' /tmp/spin0/pipelines/tokenize_pool.py
for arm in spin20 spin0; do
  [ $SECONDS -gt 480 ] && break
  dir=$root; [ "$arm" = spin0 ] && dir=/tmp/spin0
  echo "== $arm at ${SECONDS}s: $(grep '^SPIN_SECONDS' $dir/pipelines/tokenize_pool.py)" | tee -a "$out/bench.log"
  (cd "$dir" && timeout $((585 - SECONDS)) python3 -m bench.serve_bench --minilm /tmp/minilm-random \
    --corpus "$root/.bench-data/docstrings.parquet" --suites batch --batch-requests 60 --no-peers \
    --out "$out/ab_$arm") > "$out/ab_$arm.log" 2>&1
  grep -E "batch|engine alone" "$out/ab_$arm.log" | tail -3 | tee -a "$out/bench.log"
done
cd "$out" && tar -cf benches.tar $(ls -d gpu_engine ab_* 2>/dev/null) && rm -rf gpu_engine ab_*
