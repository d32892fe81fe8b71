import sys, time, platform
from pathlib import Path
import tokenizers
from pipelines.tokenize import TextTokenizer
from bench.gpu_rerank import long_documents, QUERY
tok = TextTokenizer(Path('.bundle/minilm/tokenizer.json'), 512)
print('python', platform.python_version(), 'tokenizers', tokenizers.__version__, 'library', tok._words._library is not None,
      [t.normalized for t in tok.tokenizer.get_added_tokens_decoder().values()])
docs = long_documents(Path('.bench-data/docstrings.parquet'), tok, 50)
for i, d in enumerate(docs[:26]):
    ts = []
    for _ in range(20):
        s = time.perf_counter(); tok.encode_pairs([QUERY], [d]); ts.append(time.perf_counter() - s)
    ts.sort()
    print(i, d.isascii(), None if d.isascii() else tok._words.raw_ids(d, 600) is None, f'{ts[10]*1e3:.3f} ms', flush=True)
