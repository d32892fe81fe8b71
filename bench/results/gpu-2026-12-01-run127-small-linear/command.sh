# run127: a Triton linear for few-token batches against cuBLAS as the engine calls it (.ab/skinny.py, kept here).
set -u
out=${OUT:-bench-out}
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$out/machine.txt"
python3 .ab/skinny.py "$out/skinny" 2>&1 | tee "$out/skinny.log"
cp .ab/skinny.py "$out/"
