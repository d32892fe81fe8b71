#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, then benchmarks one after the other. Output under $OUT.
#   bench/run_on_gpu.sh "<pytest args>" "<bench module and args>" ["<bench module and args>" ...]
# e.g. bench/run_on_gpu.sh "tests/test_gpu.py" "bench.gpu_rerank --corpus .bench-data/docstrings.parquet"
# Each benchmark runs as `python3 -m MODULE ARGS --out $OUT/NAME` (NAME: the module's last part).
# Installs .bundle/whl (flashinfer) and .whl (what the GPU machine lacks: the serving stack, openai for
# tests/test_serve.py, py-spy for bench.serve_bench --profile; pip download --no-deps fastapi starlette pydantic
# pydantic_core annotated-types typing-inspection opentelemetry-api uvicorn httptools uvloop orjson openai httpx2
# httpcore2 truststore jiter distro sniffio py-spy for cp312 manylinux; pytest-xdist and execnet, for `-n N` in the
# pytest arguments, so that FlashInfer's JIT modules compile side by side) when carried; MiniLM comes from
# .bundle/minilm and the corpus from .bench-data/ (../shared/gpu/make-bundle.sh and a copy of ../shared/corpus).
set -uo pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 EMBEDCTL_TEST_MODEL=${EMBEDCTL_TEST_MODEL:-.bundle/minilm}
wheels=$(ls .bundle/whl/*.whl .whl/*.whl 2>/dev/null)  # flashinfer; fastapi, uvicorn and pydantic (.whl/)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $wheels && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# .bundle/site.tar.xz: the flashinfer wheels unpacked and packed with xz, 19 MiB against 62 (so it fits in a
# call's carry beside .bundle/minilm): for w in .bundle/whl/*.whl; do unzip -qo "$w" -d site; done; tar -cJf
# .bundle/site.tar.xz -C site .
if [ -f .bundle/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
{ date -u; cat COMMIT 2>/dev/null || git rev-parse --short HEAD; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/machine.txt"
# eval: $1 may quote a -k expression. No -q of our own: a -v in $1 then names each test as it ends, which a run cut
# by its time limit needs (run173's log, under -q, had dots and no names).
eval python3 -m pytest -p no:cacheprovider -ra "$1" 2>&1 | tee "$out/tests.log"
tests=$?  # pytest's, through pipefail: the script ends with it, so a failed test is not hidden by the benchmarks after it
echo "pytest rc $tests" | tee -a "$out/tests.log"
shift
for bench in "$@"; do
  module=${bench%% *}
  name=${module##*.}
  echo "== $bench" | tee -a "$out/bench.log"
  python3 -m $bench --out "$out/$name" 2>&1 | tee -a "$out/bench.log"
done
exit "$tests"
