python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"; } | tee $OUT/machine.txt
S="python3 -m bench.serve_bench --minilm $PWD/.bundle/minilm --corpus $PWD/.bench-data/docstrings.parquet --suites batch --batch-requests 100 --no-peers"
for r in 1 2; do for arm in before after parts8; do d=.; [ $arm != after ] && d=.ab/$arm; echo "== round $r arm $arm" | tee -a $OUT/bench.log; (cd $d && $S --out $OUT/$arm$r 2>&1 | grep -E "batch|== embedctl" | tee -a $OUT/bench.log); done; done
