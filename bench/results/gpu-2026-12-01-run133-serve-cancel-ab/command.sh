# run133: does serve's cancellation cost anything? Three trees, interleaved in two rounds, embedctl only, no py-spy:
#   before  = 6563bf3 (no cancellation: the last session's first measured commit, run129)
#   head    = 06d3992 (512faaa/2a97bd6: a done-callback on every request's future cancels its scheduler request)
#   variant = the working tree (no callback: the awaiting task cancels the scheduler request when it is cancelled)
set -u
cp .ab/exp133.sh "$OUT/command.sh"
R=$PWD
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/machine.txt"
for round in 1 2; do
  for arm in before head variant; do
    dir=$R/.ab/$arm; [ $arm = variant ] && dir=$R
    echo "== round $round $arm" | tee -a "$OUT/bench.log"
    (cd "$dir" && python3 -m bench.serve_bench --minilm "$R/.bundle/minilm" --corpus "$R/.bench-data/docstrings.parquet" \
      --requests 100 --batch-requests 60 --no-peers --out "$OUT/$arm-$round") > "$OUT/$arm-$round.log" 2>&1
    grep -E "^  (query|batch|doc512)" "$OUT/$arm-$round.log" | cut -c1-110 | tee -a "$OUT/bench.log"
  done
done
