#!/usr/bin/env bash
# run164: does freezing serve's start-up objects (a74e975) change issue 4's concurrency suite? serve_bench's
# short-query and 512-token points, embedctl only, 600 timed requests a client, alternating this tree (after)
# and 4b6f309's code (before: a copy of the tree with .ab/before164.patch, `git diff HEAD 4b6f309 -- embedctl engine
# pipelines`, applied), two rounds.
set -u
out=${OUT:-bench-out}
cp .ab/exp164.sh "$out/command.sh"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
root=$PWD
mkdir -p /tmp/before && cp -r embedctl engine pipelines bench sample_data pyproject.toml /tmp/before && patch -s -d /tmp/before -p1 < .ab/before164.patch || exit 1
for round in 1 2; do
  for arm in after before; do
    dir=$root; [ "$arm" = before ] && dir=/tmp/before
    echo "== $arm round $round" | tee -a "$out/ab.log"
    (cd "$dir" && timeout 130 python3 -m bench.serve_bench --minilm "$root/.bundle/minilm" \
      --suites concurrency --requests 600 --no-peers \
      --out "$out/$arm$round") > "$out/$arm$round.log" 2>&1
    grep -E "^\| (query|doc512)" "$out/$arm$round.log" | tee -a "$out/ab.log"
  done
done
