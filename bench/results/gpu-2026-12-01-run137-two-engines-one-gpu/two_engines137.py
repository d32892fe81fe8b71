"""run137 on one H200 (no two-GPU machine was lent): two MiniLM engines on cuda:0 fed in turn by run_index, which is
what `--device cuda:0,cuda:1` does across GPUs. The output must equal one engine's, row for row, and each engine
must have stepped half the batches. Writes two_engines137.json to the folder given."""
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench.multi_gpu_index import counted
from engine import Engine, EngineConfig
from pipelines.index import IndexModel, IndexOptions, run_index

out, minilm = Path(sys.argv[1]), sys.argv[2]
results, tables = {}, {}
for n in (1, 2):
    engines = [Engine.load(minilm, EngineConfig(device="cuda:0", max_batch_tokens=2048)) for _ in range(n)]
    steps = [0] * n
    for i, engine in enumerate(engines):
        engine.step = counted(engine.step, steps, i)
    path = out / f"two-engines-{n}.parquet"
    started = time.perf_counter()
    report = run_index(IndexModel.loaded(*engines), IndexOptions(source=".bench-data/docstrings.parquet", out=str(path)))
    results[n] = {"seconds": round(time.perf_counter() - started, 2), "steps": steps, "rows": report.rows_written,
                  "device": report.device, "graphs": report.graphs}
    tables[n] = pq.read_table(path)
    path.unlink()
assert tables[1].column("id").to_pylist() == tables[2].column("id").to_pylist(), "rows out of order"
one, two = (np.stack(t.column("vector").to_numpy(zero_copy_only=False)) for t in (tables[1], tables[2]))
results["max_abs_diff"] = float(np.abs(one - two).max())
print(json.dumps(results, indent=1))
(out / "two_engines137.json").write_text(json.dumps(results, indent=1))
