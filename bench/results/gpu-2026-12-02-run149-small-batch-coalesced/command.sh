# run149: engine/small_batch.py with coalesced weight reads, its variants timed, and a race check (micro149.py),
# one process per shape (run149's first try faulted on the small-bert shape and took the others with it).
cp .ab/exp149.sh "$OUT/command.sh"; cp .ab/micro149.py "$OUT/"
for shape in minilm bert-base; do PYTHONPATH=$PWD timeout 150 python3 .ab/micro149.py "$OUT" $shape 2>&1 | grep -v Warn | tail -8; done
CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=$PWD timeout 100 python3 .ab/micro149.py "$OUT" small-bert 2>&1 | grep -v Warn | tail -30
