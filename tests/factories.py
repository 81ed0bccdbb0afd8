"""Tiny models, tokenizers and adapters made on the spot for tests: random weights, saved as
Hugging Face / PEFT folders, nothing downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, bos_token_id=1,
    eos_token_id=2,
)


def hf_config(arch: str, **overrides: Any):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama":  # Llama 3 style: rope scaling that matters at these lengths
        return LlamaConfig(**{**TINY, "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **overrides})
    if arch == "qwen2":  # q/k/v bias, tied embeddings
        return Qwen2Config(**{**TINY, "tie_word_embeddings": True, **overrides})
    if arch == "mistral":
        return MistralConfig(**{**TINY, "sliding_window": None, **overrides})
    raise ValueError(arch)


def make_hf_model(arch: str, folder: Path, seed: int = 0, config: dict | None = None, **save_options: Any):
    """A random tiny model saved to `folder` (`config`: overrides of its config); returns the
    transformers model (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **(config or {}))).eval()
    with torch.no_grad():  # qwen2 biases start at zero; make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder, **save_options)
    save_byte_tokenizer(folder)
    return model


def save_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer: one token per byte (ids 3..258), specials 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: 3 + i for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(folder)


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    targets: tuple[str, ...]
    rank: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict | None = None
    alpha_pattern: dict | None = None


ADAPTERS = (
    AdapterSpec("qv4", ("q_proj", "v_proj"), rank=4, alpha=8),
    AdapterSpec("all8", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                rank=8, alpha=16, use_rslora=True),
    AdapterSpec("mlp16", ("o_proj", "gate_proj", "down_proj"), rank=16, alpha=16),
    AdapterSpec("pattern", ("q_proj", "k_proj", "up_proj"), rank=8, alpha=16,
                rank_pattern={"k_proj": 2}, alpha_pattern={"up_proj": 4}),
)


def make_adapter(base_model, spec: AdapterSpec, folder: Path, seed: int = 1) -> Path:
    """Train nothing: a PEFT adapter with random A and B (PEFT starts B at zero), saved as
    safetensors. `base_model` is left unchanged."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
        use_rslora=spec.use_rslora, rank_pattern=spec.rank_pattern or {},
        alpha_pattern=spec.alpha_pattern or {}, init_lora_weights=False, task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    path = folder / spec.name
    peft_model.save_pretrained(path)
    return path


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_SEVEN = ATTENTION + ("gate_proj", "up_proj", "down_proj")




def load_peft_adapters(base_model, adapters: dict[str, Path]):
    """A PeftModel over a copy of `base_model` holding every adapter (name -> folder), in eval
    mode; `set_adapter(name)` picks one."""
    import copy

    from peft import PeftModel

    first, *rest = adapters
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), adapters[first], adapter_name=first)
    for name in rest:
        peft_model.load_adapter(adapters[name], adapter_name=name)
    return peft_model.eval()


def generate_with_logits(llm, prompts: list[list[int]], adapters: list[str | None], params):
    """`llm.generate` that also returns each output's logits, [generated tokens, vocab], as the
    engine sampled from them (the runner's on_logits hook)."""
    import torch

    logits: dict[str, list] = {}

    def record(sampled_ids, step_logits):
        for request_id, row in zip(sampled_ids, step_logits):
            logits.setdefault(request_id, []).append(row.clone())

    llm.engine.runner.on_logits = record
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=adapters)
    return outputs, [torch.stack(logits[output.request_id]) for output in outputs]


def make_adapters(base_model, folder: Path) -> dict[str, Path]:
    """Every adapter of ADAPTERS for `base_model`, saved under `folder` (seeds 1, 2, ...)."""
    return {spec.name: make_adapter(base_model, spec, folder, seed=i + 1) for i, spec in enumerate(ADAPTERS)}

def make_dora_adapter(base_model, folder: Path, targets: tuple[str, ...], rank: int, alpha: float,
                      seed: int = 1) -> Path:
    """A PEFT DoRA adapter (use_dora) with random A, B and magnitudes away from the row norms,
    saved by PEFT itself."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_dora=True,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
            elif "lora_magnitude_vector" in name:
                param.mul_(1 + 0.3 * torch.randn_like(param))
    peft_model.save_pretrained(folder)
    return folder


def make_ia3_adapter(base_model, folder: Path, targets: tuple[str, ...],
                     feedforward: tuple[str, ...], seed: int = 1) -> Path:
    """A PEFT IA3 adapter with vectors around 1, saved by PEFT itself."""
    import copy

    from peft import IA3Config, get_peft_model

    torch.manual_seed(seed)
    config = IA3Config(target_modules=list(targets), feedforward_modules=list(feedforward),
                       task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "ia3_l" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
    peft_model.save_pretrained(folder)
    return folder


def make_flora_adapter(base_model, folder: Path, targets: tuple[str, ...], rank: int,
                       seed: int = 1) -> Path:
    """A FLoRA adapter saved by the demo trainer's writer: B A about 1, with 30% noise."""
    from loraplex.demo.flora import add_flora, save_flora

    torch.manual_seed(seed)
    return save_flora(add_flora(base_model, rank, targets, init_noise=0.3), folder)
