#!/usr/bin/env bash
# run165: run164 again with the arms' order reversed (before first in each round), and a gc.callbacks probe
# (.ab/gcprobe/sitecustomize.py) in each server writing every collection's count and time per generation and each
# full pass at exit: does serve's gc.freeze (a74e975) make full passes frequent on the GPU host, or was run164's
# slower after arm the order?
set -u
out=$(realpath -m "${OUT:-bench-out}")
cp .ab/exp165.sh "$out/command.sh"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
root=$PWD
export PYTHONPATH=/tmp/site:$root/.ab/gcprobe
mkdir -p /tmp/before && cp -r embedctl engine pipelines bench sample_data pyproject.toml /tmp/before && patch -s -d /tmp/before -p1 < .ab/before164.patch || exit 1
for round in 1 2; do
  for arm in before after; do
    dir=$root; [ "$arm" = before ] && dir=/tmp/before
    mkdir -p "$out/gc-$arm$round"
    echo "== $arm round $round" | tee -a "$out/ab.log"
    (cd "$dir" && GCPROBE_OUT="$out/gc-$arm$round" timeout 130 python3 -m bench.serve_bench --minilm "$root/.bundle/minilm" \
      --suites concurrency --requests 600 --no-peers \
      --out "/tmp/r-$arm$round") > "$out/$arm$round.log" 2>&1
    grep -E "^\| (query|doc512)" "$out/$arm$round.log" | tee -a "$out/ab.log"
    cat "$out/gc-$arm$round"/*.json | python3 -c "import json,sys; d=json.load(sys.stdin); print('objects', d['objects'], 'frozen', d['frozen'], 'per generation [count, ms total, ms max]', d['stats'], 'full passes (s, ms, frozen)', d['full'])" | tee -a "$out/ab.log"
  done
done
