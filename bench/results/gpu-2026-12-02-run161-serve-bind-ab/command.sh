#!/usr/bin/env bash
# run161: is run160's 4 x 100-document figure (37% of the engine alone, 48% in run158) this session's serve change
# (bind, then listen once loaded) or the host? serve_bench's batch suite alone, embedctl only, alternating this
# tree (after) and e3bec16's code (before, under .ab/e3bec16), two rounds.
set -u
out=${OUT:-bench-out}
cp .ab/exp161.sh "$out/command.sh"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
root=$PWD
for round in 1 2; do
  for arm in after before; do
    dir=$root; [ "$arm" = before ] && dir=$root/.ab/e3bec16
    echo "== $arm round $round" | tee -a "$out/ab.log"
    (cd "$dir" && timeout 140 python3 -m bench.serve_bench --minilm "$root/.bundle/minilm" \
      --corpus "$root/.bench-data/docstrings.parquet" --suites batch --batch-requests 100 --no-peers \
      --out "$out/$arm$round") > "$out/$arm$round.log" 2>&1
    grep -E "batch 4 x|\| embedctl \|" "$out/$arm$round.log" | tee -a "$out/ab.log"
  done
done
