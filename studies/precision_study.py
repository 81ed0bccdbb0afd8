"""Where a bf16 engine loses accuracy against float32 on a random Llama, on the CPU, in plain
torch (the engine is not imported).

A self-contained full-sequence Llama forward (RMSNorm, Llama-3 RoPE, causal GQA attention,
SwiGLU, untied lm_head) runs in float32 and rounds activations to bf16 only where a
`Precision` says, so one weight set (bf16-rounded, held in float32) gives both the bf16
engine's numbers and the float32 reference's. A bf16 GEMM is emulated as: inputs rounded to
bf16, float32 product (exact for bf16 x bf16), output rounded or not. "split" rounds an input
to hi + lo, hi = bf16(x), lo = bf16(x - hi) (16 significant bits): the two-pass bf16 GEMM
W hi + W lo, emulated as one float32 GEMM of the exact sum hi + lo.

    python studies/precision_study.py [--quick] [--skip-width] [--render]

Writes studies/results/precision-study-cpu.json and precision-study-cpu.md."""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

STUDY_RESULTS = Path("studies/results")
"""Where the studies' results go (run them from the repository root)."""


LLAMA3_ROPE = dict(theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max=8192)
MAX_AGREEMENT_GAP = 0.01
"""Required: at least 99 % identical greedy tokens."""
MAX_REL_ERROR = 2e-2
"""Required: logits within 2e-2 relative error."""


@dataclass(frozen=True)
class Shape:
    hidden: int = 1024
    intermediate: int = 3584
    num_layers: int = 32
    num_heads: int = 16
    num_kv_heads: int = 4
    vocab: int = 128256
    """Llama-3's vocabulary: how close the top two logits sit depends on how many there are."""
    num_seqs: int = 8
    seq_len: int = 128
    gain_width: int = 4096
    """Matrices are drawn with std * sqrt(gain_width / hidden): each GEMM's gain std * sqrt(fan_in)
    is then Llama-3-8B's (hidden 4096) and so is the error (set gain_width = hidden for the
    plain init). The embedding keeps std: it is looked up, not multiplied."""
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


@dataclass(frozen=True)
class Init:
    """Weight standard deviations as at Llama-3-8B's width (see Shape.gain_width); norms 1."""

    name: str
    std: float = 0.02
    """Every weight matrix N(0, std) unless overridden below."""
    residual_scale: float = 1.0
    """o_proj and down_proj (the writes into the residual stream) get std * residual_scale."""
    embed_std: float | None = None
    """Default: std."""
    tie_head: bool = False
    """lm_head = embedding (then head_scale is unused)."""
    head_scale: float = 1.0
    """lm_head std = std * head_scale: peaks the softmax, scales every logit alike."""
    note: str = ""


@dataclass(frozen=True)
class Precision:
    """Where activations are rounded. Modes: "bf16" rounds, "split" keeps hi + lo (16 bits),
    "fp32" keeps float32."""

    name: str
    residual: str = "bf16"
    """The residual stream after each add."""
    gemm_outputs: str = "bf16"
    """Outputs of the qkv, o, gate_up and down GEMMs. (The norm, RoPE, attention and silu * mul
    outputs each feed a GEMM and are rounded as its input.)"""
    gemm_inputs: str = "bf16"
    """x of the weight GEMMs qkv, o, gate_up, down."""
    attention_inputs: str = "bf16"
    """q, K, V and P of the two attention GEMMs. "split_qp": q and P split, K and V bf16 (a bf16
    KV cache); "kv_bf16": q and P float32, K and V bf16."""
    head_input: str = "bf16"
    """x of the lm_head GEMM."""
    logits: str = "bf16"
    """The lm_head output (the engine returns bf16-rounded logits above 16 rows)."""
    perturb_layer: int = -1
    """If >= 0: round the residual stream to bf16 once, after this layer (error propagation)."""
    note: str = ""


FP32 = Precision("fp32 reference", *(["fp32"] * 6))


def cast(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "fp32":
        return x
    hi = x.bfloat16().float()
    if mode == "bf16":
        return hi
    if mode == "split":
        return hi + (x - hi).bfloat16().float()
    raise ValueError(f"unknown rounding mode {mode!r}")


@dataclass
class Layer:
    qkv: torch.Tensor  # [q + 2 kv, hidden]
    o: torch.Tensor  # [hidden, q]
    gate_up: torch.Tensor  # [2 intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class Weights:
    """bf16-rounded values held in float32; norm weights are all 1 and left out."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[Layer]
    head: torch.Tensor  # [vocab, hidden]
    cos: torch.Tensor  # [seq_len, head_dim / 2]
    sin: torch.Tensor


def make_weights(shape: Shape, init: Init, seed: int = 0) -> Weights:
    generator = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.empty(rows, cols).normal_(0.0, std, generator=generator).bfloat16().float()

    h, q, kv, inter = shape.hidden, shape.hidden, shape.num_kv_heads * shape.head_dim, shape.intermediate
    embed = normal(shape.vocab, h, init.embed_std or init.std)
    std = init.std * math.sqrt(shape.gain_width / shape.hidden)
    res_std = std * init.residual_scale
    layers = [Layer(normal(q + 2 * kv, h, std), normal(h, q, res_std), normal(2 * inter, h, std),
                    normal(h, inter, res_std)) for _ in range(shape.num_layers)]
    head = embed if init.tie_head else normal(shape.vocab, h, std * init.head_scale)
    cos, sin = rope_tables(shape.head_dim, shape.seq_len)
    return Weights(embed, layers, head, cos, sin)


def rope_tables(head_dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 3.1's frequency-scaled RoPE (theta 500000), as Hugging Face computes it."""
    r = LLAMA3_ROPE
    inv_freq = 1.0 / (r["theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    low, high, original = r["low_freq_factor"], r["high_freq_factor"], r["original_max"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r["factor"], inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / r["factor"] + smooth * scaled
    inv_freq = torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), blended, scaled)
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [seqs, heads, seq_len, head_dim], "rotate half" layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention(x: torch.Tensor, layer: Layer, w: Weights, shape: Shape, p: Precision) -> torch.Tensor:
    """x [seqs, seq_len, hidden] (normed) -> o_proj output [seqs, seq_len, hidden]."""
    modes = {"bf16": ("bf16",) * 3, "split_qp": ("split", "bf16", "split"), "split": ("split",) * 3,
             "kv_bf16": ("fp32", "bf16", "fp32"), "fp32": ("fp32",) * 3}
    q_mode, kv_mode, p_mode = modes[p.attention_inputs]
    b, t, d = shape.num_seqs, shape.seq_len, shape.head_dim
    qkv = cast(cast(x, p.gemm_inputs) @ layer.qkv.T, p.gemm_outputs)
    q, k, v = qkv.split((shape.hidden, shape.num_kv_heads * d, shape.num_kv_heads * d), dim=-1)
    q = q.view(b, t, shape.num_heads, d).transpose(1, 2)  # [seqs, heads, seq_len, head_dim]
    k = k.view(b, t, shape.num_kv_heads, d).transpose(1, 2)
    v = v.view(b, t, shape.num_kv_heads, d).transpose(1, 2)
    q = cast(rotate(q, w.cos, w.sin), q_mode)
    k = cast(rotate(k, w.cos, w.sin), kv_mode)
    group = shape.num_heads // shape.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), cast(v, kv_mode).repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5  # [seqs, heads, seq_len, seq_len], float32
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = cast(scores.masked_fill(causal, float("-inf")).softmax(dim=-1), p_mode)
    out = (probs @ v).transpose(1, 2).reshape(b, t, shape.hidden)
    return cast(cast(out, p.gemm_inputs) @ layer.o.T, p.gemm_outputs)


def mlp(x: torch.Tensor, layer: Layer, p: Precision) -> torch.Tensor:
    gate, up = cast(cast(x, p.gemm_inputs) @ layer.gate_up.T, p.gemm_outputs).chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    return cast(cast(hidden, p.gemm_inputs) @ layer.down.T, p.gemm_outputs)


@torch.no_grad()
def forward(w: Weights, shape: Shape, tokens: torch.Tensor, p: Precision,
            residuals: list[torch.Tensor] | None = None) -> torch.Tensor:
    """tokens [seqs, seq_len] -> logits [seqs * seq_len, vocab]; appends the residual stream
    after each layer to `residuals`."""
    residual = w.embed[tokens]  # [seqs, seq_len, hidden]
    for i, layer in enumerate(w.layers):
        x = rms_norm(residual, shape.eps)
        residual = cast(residual + attention(x, layer, w, shape, p), p.residual)
        x = rms_norm(residual, shape.eps)
        residual = cast(residual + mlp(x, layer, p), p.residual)
        if i == p.perturb_layer:
            residual = cast(residual, "bf16")
        if residuals is not None:
            residuals.append(residual.reshape(-1, shape.hidden))
    x = cast(rms_norm(residual, shape.eps), p.head_input)
    return cast(x.reshape(-1, shape.hidden) @ w.head.T, p.logits)


def rel_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row ||a - b|| / ||b||, rows [n, dim]."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def compare(logits: torch.Tensor, reference: torch.Tensor, ref_gap: torch.Tensor, seq_len: int,
            ) -> dict[str, float]:
    """The accuracy check's two numbers over every position and over the second half of each
    sequence (the check compares positions 256-319, and the error grows with position), plus the
    median top-1/top-2 gap of the reference in units of the per-logit error RMS
    (||l - l_ref|| / sqrt(vocab)). logits, reference [seqs * seq_len, vocab]."""
    errors = rel_errors(logits, reference)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float()
    per_logit = (logits - reference).norm(dim=-1) / math.sqrt(reference.shape[-1])
    late = (torch.arange(len(errors)) % seq_len) >= seq_len // 2
    return {
        "identical_greedy_fraction": round(float(agree.mean()), 5),
        "identical_greedy_fraction_late": round(float(agree[late].mean()), 5),
        "rel_error_median": float(errors.median()),
        "rel_error_median_late": float(errors[late].median()),
        "rel_error_p99": float(torch.quantile(errors, 0.99)),
        "rel_error_max": float(errors.max()),
        "gap_over_logit_error_median": float((ref_gap / per_logit).median()),
    }


def logit_stats(reference: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """How peaked the float32 logits are: top-1 probability and top-1 minus top-2 logit, also
    in units of the logits' own standard deviation. Returns (stats, gap per position)."""
    top = reference.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    probs = torch.softmax(reference, dim=-1).max(dim=-1).values
    std = reference.std(dim=-1)

    def q(x: torch.Tensor) -> dict[str, float]:
        return {k: float(torch.quantile(x, v)) for k, v in (("p10", 0.1), ("median", 0.5), ("p90", 0.9))}

    return {"top1_prob": q(probs), "top1_top2_gap": q(gap), "gap_over_logit_std": q(gap / std),
            "logit_std_median": float(std.median())}, gap


def residual_growth(residuals: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    """Median over tokens of the residual stream's relative error after each layer."""
    return [round(float(rel_errors(a, b).median()), 6) for a, b in zip(residuals, reference)]


def run_init(shape: Shape, init: Init, variants: list[Precision], seed: int = 0,
             head_scales: tuple[float, ...] = ()) -> dict[str, Any]:
    """The float32 reference and every variant on one random model and one batch of random
    tokens. `head_scales`: also the reference's logit statistics with lm_head scaled by each
    (a power of two commutes with bf16 rounding: the variants' figures stay exactly the same)."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(1000, shape.vocab - 1000, (shape.num_seqs, shape.seq_len), generator=generator)
    w = make_weights(shape, init, seed)
    ref_residuals: list[torch.Tensor] = []
    reference = forward(w, shape, tokens, FP32, ref_residuals)
    stats, gap = logit_stats(reference)
    scaled = {str(k): logit_stats(reference * k)[0] for k in head_scales}
    _progress(f"{init.name}: weights and float32 reference", started)
    results = []
    for p in variants:
        residuals: list[torch.Tensor] = []
        logits = forward(w, shape, tokens, p, residuals)
        results.append({"variant": p.name, "precision": asdict(p),
                        **compare(logits, reference, gap, shape.seq_len),
                        "residual_rel_error_by_layer": residual_growth(residuals, ref_residuals)})
        del logits, residuals
        r = results[-1]
        _progress(f"{init.name}: {p.name}: agree {r['identical_greedy_fraction']:.4f}, "
                  f"rel err {r['rel_error_median']:.4f}", started)
    return {"init": asdict(init), "shape": asdict(shape), "reference_logits": stats,
            "reference_logits_head_scaled": scaled, "variants": results,
            "seconds": round(time.perf_counter() - started, 1)}


def _progress(what: str, started: float) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {what}", flush=True)


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of Llama-3-8B at the accuracy check's batch and context."""

    batch: int = 64
    context: int = 320
    hidden: int = 4096
    intermediate: int = 14336
    num_layers: int = 32
    q_size: int = 4096
    kv_size: int = 1024
    vocab: int = 128256
    ridge_flop_per_byte: float = 989e12 / 3.35e12
    """H100 SXM: dense bf16 FLOP/s over HBM bytes/s; GEMMs below it are memory-bound."""


def decode_cost(p: Precision, s: DecodeStep) -> dict[str, Any]:
    """Extra HBM bytes and GEMM FLOPs of `p` over the bf16 engine per decode step, unfused
    (each kept-fp32 tensor written and read once more at 2 extra bytes an element)."""
    body_params = s.num_layers * (s.hidden * (s.q_size + 2 * s.kv_size) + s.q_size * s.hidden
                                  + 3 * s.hidden * s.intermediate)
    head_params = s.vocab * s.hidden
    kv_bytes = s.batch * s.context * s.num_layers * 2 * s.kv_size * 2
    base_bytes = 2 * (body_params + head_params) + kv_bytes
    flops = {"body": 2 * s.batch * body_params, "head": 2 * s.batch * head_params,
             "attention": 4 * s.batch * s.context * s.num_layers * s.q_size}
    extra: dict[str, int] = {}
    if p.residual == "fp32":  # two fused add + norm a layer, each reads and writes the residual
        extra["residual"] = (4 * s.num_layers + 2) * s.batch * s.hidden * 2
    if p.gemm_outputs == "fp32":  # qkv, o, gate_up, down: written and read
        per_token = s.q_size + 2 * s.kv_size + s.hidden + 2 * s.intermediate + s.hidden
        extra["gemm_outputs"] = 2 * s.num_layers * s.batch * per_token * 2
    if p.gemm_inputs == "split":  # the lo parts of the qkv, o, gate_up, down inputs
        extra["lo_inputs"] = 2 * s.num_layers * s.batch * (2 * s.hidden + s.q_size + s.intermediate) * 2
    if p.attention_inputs in ("split", "fp32"):
        extra["kv_cache"] = kv_bytes
    if p.head_input in ("split", "fp32"):
        extra["head_input"] = 2 * s.batch * s.hidden * 2
    if p.logits == "fp32":
        extra["logits"] = 2 * s.batch * s.vocab * 2
    extra_flops = (flops["body"] * (p.gemm_inputs == "split") + flops["head"] * (p.head_input == "split")
                   + flops["attention"] * (p.attention_inputs in ("split", "split_qp")))
    total = sum(extra.values())
    return {"extra_bytes": total, "extra_fraction": total / base_bytes, "extra_bytes_by_tensor": extra,
            "extra_gemm_flops_fraction": extra_flops / sum(flops.values()),
            "needs_fp32_head_gemm": p.head_input == "fp32"}


def decode_reference(s: DecodeStep) -> dict[str, Any]:
    body = s.num_layers * (s.hidden * (s.q_size + 2 * s.kv_size) + s.q_size * s.hidden
                           + 3 * s.hidden * s.intermediate)
    return {**asdict(s), "weight_bytes": 2 * (body + s.vocab * s.hidden),
            "kv_bytes": s.batch * s.context * s.num_layers * 2 * s.kv_size * 2,
            "weight_gemm_flop_per_byte": s.batch, "split_weight_gemm_flop_per_byte": 2 * s.batch}


def precision_variants() -> list[Precision]:
    """What an engine could change, cheapest first."""
    f = "fp32"
    base = Precision("1 bf16 engine", note="every op output bf16; logits bf16 (the engine above 16 rows)")
    v2 = replace(base, name="2 fp32 residual", residual=f)
    v3 = replace(v2, name="3 only GEMM inputs bf16", gemm_outputs=f,
                 note="residual and GEMM outputs fp32; x, q, K, V, P rounded at GEMM inputs")
    v4b = replace(v3, name="4b 3 + split lm_head input", head_input="split", logits=f)
    return [
        base,
        replace(base, name="1b bf16 engine, fp32 logits", logits=f, note="the engine at <= 16 rows"),
        v2, v3,
        replace(v4b, name="4a 3 + fp32 lm_head input", head_input=f),
        v4b,
        replace(v4b, name="5a 4b + split weight-GEMM inputs", gemm_inputs="split",
                note="attention GEMMs still bf16"),
        replace(v4b, name="5 4b + split every GEMM input, bf16 KV", gemm_inputs="split",
                attention_inputs="split_qp", note="q and P split; K, V bf16 (a bf16 KV cache)"),
        replace(v4b, name="5b 5 + split K/V (2x KV cache)", gemm_inputs="split", attention_inputs="split"),
    ]


def ablations() -> list[Precision]:
    """float32 everywhere but one place: what each costs alone."""
    f = "fp32"
    return [
        Precision("only the residual bf16", "bf16", f, f, f, f, f),
        Precision("only weight-GEMM outputs bf16", f, "bf16", f, f, f, f),
        Precision("only weight-GEMM inputs bf16", f, f, "bf16", f, f, f),
        Precision("only attention inputs bf16", f, f, f, "bf16", f, f, note="q, K, V, P"),
        Precision("only the KV cache bf16", f, f, f, "kv_bf16", f, f),
        Precision("one bf16 rounding of the residual after layer 1", f, f, f, f, f, f, perturb_layer=0,
                  note="how one error propagates through depth"),
    ]


def init_variants(num_layers: int) -> list[Init]:
    return [
        Init("normal 0.02", note="HF initializer_range"),
        Init("scaled o/down", residual_scale=1 / math.sqrt(2 * num_layers), note="GPT-2: 0.02 / sqrt(2 L)"),
        Init("normal 0.01", std=0.01),
        Init("normal 0.005", std=0.005),
        Init("tied head, embedding std 8", embed_std=8.0, tie_head=True,
             note="a copy model: the input token's embedding dominates the residual, logits peak on it"),
        Init("tied head, embedding std 32", embed_std=32.0, tie_head=True, note="the same, stronger"),
    ]


def width_check(variants: list[Precision]) -> list[dict[str, Any]]:
    """Is the error set by width or by each GEMM's gain std * sqrt(fan_in)? 8 layers at Llama-3-8B's
    width against 1024 wide with the gain matched and with the plain std (512 positions each)."""
    shapes = [("4096 wide, std 0.02", Shape(hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8)),
              ("1024 wide, gain-matched (std 0.04)", Shape()),
              ("1024 wide, plain std 0.02", Shape(gain_width=1024))]
    out = []
    for label, shape in shapes:
        shape = replace(shape, num_layers=8, vocab=32000, num_seqs=4)
        result = run_init(shape, Init("normal 0.02"), variants)
        out.append({"label": label, **result})
        gc.collect()
    return out


def growth_exponent(errors: list[float]) -> float:
    """b in error(layer) ~ layer ** b, least squares in log-log: 0.5 for independent errors
    adding up, 1 for errors adding coherently, growing with depth for exponential growth."""
    layers = np.arange(1, len(errors) + 1)
    return float(np.polyfit(np.log(layers), np.log(errors), 1)[0])


def passes(r: dict[str, Any]) -> bool:
    return r["identical_greedy_fraction"] >= 1 - MAX_AGREEMENT_GAP and r["rel_error_p99"] < MAX_REL_ERROR


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke test: 4 layers, 2 sequences")
    parser.add_argument("--skip-width", action="store_true")
    parser.add_argument("--render", action="store_true", help="only rewrite the markdown from the JSON")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads((STUDY_RESULTS / "precision-study-cpu.json").read_text())
        (STUDY_RESULTS / "precision-study-cpu.md").write_text(markdown(result))
        return
    torch.set_num_threads(2)
    started = time.perf_counter()
    shape = Shape(num_layers=4, num_seqs=2, vocab=32000) if args.quick else Shape()
    variants, probes = precision_variants(), ablations()
    inits = init_variants(32)
    main_run = run_init(shape, inits[0], variants + probes, head_scales=(4.0, 16.0))
    gc.collect()
    baseline = [v for v in variants if v.name.startswith(("1 ", "3 "))]
    init_runs = [main_run] + [run_init(shape, init, baseline[:1]) for init in inits[1:]]
    gc.collect()
    width = [] if args.skip_width or args.quick else width_check(baseline)
    step = DecodeStep()
    result = {
        "check": "precision-study", "device": platform.processor() or platform.machine(),
        "torch": torch.__version__, "requirement": {"min_identical_greedy_fraction": 1 - MAX_AGREEMENT_GAP,
                                                    "max_rel_error": MAX_REL_ERROR},
        "decode_step": decode_reference(step),
        "decode_cost": {v.name: decode_cost(v, step) for v in variants},
        "main": main_run, "inits": init_runs, "width_check": width,
        "seconds": round(time.perf_counter() - started, 1),
    }
    suffix = "-quick" if args.quick else ""
    STUDY_RESULTS.mkdir(exist_ok=True)
    (STUDY_RESULTS / f"precision-study-cpu{suffix}.json").write_text(json.dumps(result, indent=1))
    (STUDY_RESULTS / f"precision-study-cpu{suffix}.md").write_text(markdown(result))
    _progress("done", started)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _variant_row(r: dict[str, Any], extra: str) -> str:
    return (f"| {r['variant']} | {_pct(r['identical_greedy_fraction'])}"
            f" | {_pct(r['identical_greedy_fraction_late'])}"
            f" | {r['rel_error_median']:.4f} | {r['rel_error_median_late']:.4f} | {r['rel_error_p99']:.4f}"
            f" | {'yes' if passes(r) else 'no'} |{extra}")


def _layers(errors: list[float]) -> str:
    picks = [i for i in (1, 2, 4, 8, 16, 32) if i <= len(errors)]
    return ", ".join(f"L{i} {errors[i - 1]:.4f}" for i in picks)


def markdown(result: dict[str, Any]) -> str:
    main_run, cost, step = result["main"], result["decode_cost"], result["decode_step"]
    shape = main_run["shape"]
    lines = [
        "# bf16 against float32 on a random Llama: where the error comes from (CPU emulation)",
        "",
        f"`python studies/precision_study.py`, {result['seconds']:.0f} s on {result['device']}, torch "
        f"{result['torch']}. A plain-torch Llama ({shape['num_layers']} layers, hidden {shape['hidden']}, "
        f"intermediate {shape['intermediate']}, {shape['num_heads']}/{shape['num_kv_heads']} heads, vocab "
        f"{shape['vocab']}), {shape['num_seqs']} x {shape['seq_len']} random tokens, teacher-forced, "
        "bf16-rounded weights in both runs. Matrices are drawn at std x sqrt(4096 / hidden) so each GEMM's "
        "gain std x sqrt(fan_in) is Llama-3-8B's (the width check below shows that this, not the width, sets "
        "the error). \"late\": positions 64-127 (the GPU check compares positions 256-319). "
        "Pass: >= 99 % identical greedy tokens and p99 relative error < 2e-2. Extra traffic: Llama-3-8B, "
        f"batch {step['batch']}, context {step['context']}, unfused, against "
        f"{(step['weight_bytes'] + step['kv_bytes']) / 1e9:.1f} GB a step (weights + KV).",
        "",
        "## Precision variants, init normal 0.02",
        "",
        "| variant | greedy agree | agree late | rel err median | median late | p99 | pass "
        "| extra HBM bytes / step | extra GEMM FLOPs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in main_run["variants"][:len(cost)]:
        c = cost[r["variant"]]
        fp32_head = ", fp32 lm_head GEMM" if c["needs_fp32_head_gemm"] else ""
        lines.append(_variant_row(r, f" {c['extra_bytes'] / 1e6:.0f} MB ({_pct(c['extra_fraction'])}) | "
                                     f"{_pct(c['extra_gemm_flops_fraction'])}{fp32_head} |"))
    lines += ["", "## Ablations: float32 but one place", "",
              "| rounded to bf16 | greedy agree | agree late | rel err median | median late | p99 | pass |",
              "|---|---|---|---|---|---|---|"]
    lines += [_variant_row(r, "") for r in main_run["variants"][len(cost):]]
    lines += ["", "## Inits, bf16 engine (variant 1)", "",
              "| init | greedy agree | agree late | rel err median | median late | p99 | pass | top-1 prob "
              "p10 / median / p90 | (top1 - top2) / logit std | (top1 - top2) / logit error |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["inits"]:
        r, st = run["variants"][0], run["reference_logits"]
        probs = " / ".join(f"{st['top1_prob'][k]:.2g}" for k in ("p10", "median", "p90"))
        lines.append(_variant_row({**r, "variant": run["init"]["name"]},
                                  f" {probs} | {st['gap_over_logit_std']['median']:.3f} | "
                                  f"{r['gap_over_logit_error_median']:.1f} |"))
    for k, st in main_run["reference_logits_head_scaled"].items():
        probs = " / ".join(f"{st['top1_prob'][q]:.2g}" for q in ("p10", "median", "p90"))
        lines.append(f"| normal 0.02, lm_head x{float(k):g} | same as normal 0.02, bit for bit | | | | | | "
                     f"{probs} | {st['gap_over_logit_std']['median']:.3f} | |")
    perturbed = main_run["variants"][-1]["residual_rel_error_by_layer"]
    lines += ["", "## Error of the residual stream by layer (median over tokens)", ""]
    shown = [r for r in main_run["variants"] if r["variant"].startswith(("1 ", "3 ", "5 "))]
    for r in shown + main_run["variants"][-1:]:
        errors = r["residual_rel_error_by_layer"]
        lines.append(f"- {r['variant']}: {_layers(errors)}; growth exponent b (error ~ layer^b) "
                     f"{growth_exponent(errors[1:] if errors[0] == 0 else errors):.2f}")
    lines.append(f"- a single rounding after layer 1 grows x{perturbed[-1] / perturbed[0]:.1f} over "
                 f"{len(perturbed) - 1} layers, x{2 ** growth_exponent(perturbed):.2f} per doubling of depth")
    if result["width_check"]:
        lines += ["", "## Width check: 8 layers, vocab 32000, 4 x 128 tokens", "",
                  "| model | variant | residual rel err after layer 8 | logits rel err median "
                  "| greedy agree |",
                  "|---|---|---|---|---|"]
        for run in result["width_check"]:
            for r in run["variants"]:
                last = r["residual_rel_error_by_layer"][-1]
                lines.append(f"| {run['label']} | {r['variant']} | {last:.4f} | {r['rel_error_median']:.4f}"
                             f" | {_pct(r['identical_greedy_fraction'])} |")
    lines += ["", "## Findings", ""] + findings(result)
    return "\n".join(lines) + "\n"


def findings(result: dict[str, Any]) -> list[str]:
    """The sentences that follow from the numbers alone."""
    variants = result["main"]["variants"]
    base = variants[0]
    out = [f"- The bf16 engine: {_pct(base['identical_greedy_fraction'])} identical greedy tokens, median "
           f"relative error {base['rel_error_median']:.4f}."]
    options = variants[:len(result["decode_cost"])]
    for r in options[1:]:
        out.append(f"- {r['variant']}: error x{r['rel_error_median'] / base['rel_error_median']:.2f} of the "
                   f"engine's, agreement {_pct(r['identical_greedy_fraction'])}.")
    passing = [r["variant"] for r in options if passes(r)]
    out.append(f"- Passing both on the default init: {', '.join(passing) or 'none'}.")
    probes = {r["variant"]: r for r in variants[len(options):]}
    alone = "; ".join(f"{name.removeprefix('only ')} {r['rel_error_median']:.4f} / "
                      f"{_pct(r['identical_greedy_fraction'])}" for name, r in probes.items())
    out.append(f"- One place in bf16, the rest float32 (error / agreement): {alone}. Every source alone "
               "fails 99 %; the bf16 KV cache alone is the floor of variant 5.")
    errors = base["residual_rel_error_by_layer"]
    perturbed = variants[-1]["residual_rel_error_by_layer"]
    b_engine, b_one = growth_exponent(errors), growth_exponent(perturbed)
    early, late = errors[3] / errors[1], errors[-1] / errors[len(errors) // 2 - 1]
    out.append(f"- Depth: the engine's residual error grows as a power law, layer^{b_engine:.2f}, and one "
               f"injected error as layer^{b_one:.2f}; per doubling of depth x{early:.2f} from layer 2 to 4, "
               f"x{late:.2f} from {len(errors) // 2} to {len(errors)}: no exponential (chaotic) blow-up.")
    if result["width_check"]:
        last = [(run["label"], run["variants"][0]["residual_rel_error_by_layer"][-1])
                for run in result["width_check"]]
        listed = ", ".join(f"{e:.4f} ({label})" for label, e in last)
        out.append(f"- Width: residual error after 8 layers {listed}: the GEMM gain std x sqrt(fan_in), not "
                   "the width, sets the error.")
    init_pass = [run["init"]["name"] for run in result["inits"] if passes(run["variants"][0])]
    out.append(f"- Inits passing both with the bf16 engine: {', '.join(init_pass) or 'none'}.")
    random_head = options + [run["variants"][0] for run in result["inits"] if not run["init"]["tie_head"]]
    ratios = [(1 - r["identical_greedy_fraction"]) / r["rel_error_median"] for r in random_head
              if r["rel_error_median"] > 0.005]
    c = float(np.median(ratios))
    out.append(f"- With a random lm_head the share of flipped greedy tokens is about {c:.1f} x the median "
               f"relative error (median over {len(ratios)} runs, range {min(ratios):.1f}-{max(ratios):.1f}): "
               f">= 99 % agreement needs a relative error below about {0.01 / c:.4f}.")
    return out


if __name__ == "__main__":
    main()
