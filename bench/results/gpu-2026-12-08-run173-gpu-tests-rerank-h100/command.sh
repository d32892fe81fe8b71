#!/usr/bin/env bash
# run173, one call: every GPU test on 92a8f4d with FlashInfer installed (run167 last ran them all, on d3c87c7's
# engine; since then engine/ changed in graphs.py's docstrings and checkpoint.py's host-side default_prompt_name check;
# the lanes test's Triton and FlashInfer parameters have never run), in 6 pytest-xdist processes so that FlashInfer's
# JIT modules compile side by side; MiniLM with random weights built here from its config (the carry holds FlashInfer
# or MiniLM's weights, not both). Then issue 5's rerank suite (5 / 25 / 50 pairs, ours against sentence-transformers).
set -u
out=${OUT:-bench-out}
cp .ab/exp173.sh "$out/command.sh"
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
timeout 280 bench/run_on_gpu.sh "-v -n 6 -m gpu tests/test_gpu.py tests/test_qwen3.py tests/test_serve.py"
echo "tests rc $? at ${SECONDS}s" >> "$out/tests.log"
export PYTHONPATH=/tmp/site
echo "== bench.gpu_rerank at ${SECONDS}s" | tee -a "$out/bench.log"
timeout $((370 - SECONDS)) python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 40 --arms ours,ours_model_only,sentence_transformers_fp16 \
  --out "$out/gpu_rerank" 2>&1 | grep -v DEBUG | tail -40 | tee -a "$out/bench.log"
echo "bench rc ${PIPESTATUS[0]} at ${SECONDS}s" >> "$out/bench.log"
grep -v DEBUG "$out/tests.log" | tail -30
tail -30 "$out/bench.log"
# Then, on the same warm machine (the FlashInfer JIT modules and /tmp/site kept), with the device time left:
#   export PYTHONPATH=/tmp/site EMBEDCTL_TEST_MODEL=/tmp/minilm-random PYTHONUNBUFFERED=1
#   timeout 185 python3 -m pytest -p no:cacheprovider -q -n 6 -m gpu tests/test_gpu.py tests/test_qwen3.py \
#     tests/test_serve.py -rA | grep -v DEBUG | tee $OUT/tests2.log   (tests-again-warm.log)
