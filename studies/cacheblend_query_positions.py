"""The blend's recompute past layer 1 as one sequence with each token's own position (the
engine's way since the prefill attention took `query_positions`) against a sequence for each run
of consecutive tokens (the way before; the reference ops gather the prompt's keys once per
sequence): the same answers, and the time to first token of each against full prefill.
SmolLM2-135M-Instruct, float32, CPU, 4 documents of 1,024 tokens, shares 0.2 and 1.0
(loraplex.benchmarks.blending's quality part, 16-token answers).

    python studies/cacheblend_query_positions.py MODEL_DIR positions|runs QUESTIONS"""
import json
import sys
from pathlib import Path

import torch

from loraplex.benchmarks import blending as bench
from loraplex.engine import blending

model, mode, questions = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
if mode == "runs":
    blending._metadata = blending.metadata_by_runs
    blending.CHUNK_TOKENS = 64
engine = bench.make_engine(model, "cpu", "float32", 4 * 1024 + 64 + 40, None)
corpus = bench.text_corpus(model, 1024, 8)
out = bench.quality(engine, corpus, questions, (0.2, 1.0), 16, 0)
rows = [{"prompt_tokens": r["prompt_tokens"], "full_prefill_ttft_s": r["full_prefill_ttft_s"],
         **{share: cell["ttft_s"] for share, cell in r["shares"].items()}} for r in out["rows"]]
print(json.dumps({"mode": mode, "summary": out["summary"], "rows": rows}))
