# run148: the partial-sum variants of engine/small_batch.py timed on the H200 (micro148.py).
cp .ab/exp148.sh "$OUT/command.sh"; cp .ab/micro148.py "$OUT/"
PYTHONPATH=$PWD timeout 300 python3 .ab/micro148.py "$OUT" 2>&1 | tail -40
