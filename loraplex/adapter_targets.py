"""Which modules of a Llama-family model a PEFT LoRA config adapts, by PEFT's own rules (its
`check_target_module_exists`), so that an adapter whose tensors and config disagree can be
refused. Module names are those of the Hugging Face model (`model.layers.3.self_attn.q_proj`).

- `target_modules` as a string is a regular expression that must match a whole name; as a
  list, each entry is a name or a dotted suffix of one (`q_proj`, `self_attn.q_proj`);
  "all-linear" (any case) is every projection.
- `exclude_modules` (the same two forms) takes modules out.
- `layers_to_transform` (an int or a list) keeps only those layers, the first number after
  `.<layers_pattern>.` in the name (any `.<name>.` by default). As in PEFT it restricts only
  suffix matches: not a regular expression, not an exact name, not "all-linear".

The patterns are user input: they run on the `regex` module with a time limit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import regex

from loraplex.errors import AdapterError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
ALL_LINEAR = "all-linear"
MAX_PATTERN_LENGTH = 256
MAX_ENTRIES = 64
MATCH_TIME_LIMIT_S = 1.0
"""For all of one config's patterns against all module names together."""


def block_of(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


def module_names(num_layers: int) -> dict[str, tuple[int, str] | None]:
    """Every module name of the model (what PEFT matches against), each mapped to its
    (layer, projection), or None for modules that are not projections."""
    names: dict[str, tuple[int, str] | None] = dict.fromkeys(
        ("model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"))
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        for suffix in ("", ".self_attn", ".mlp", ".mlp.act_fn", ".input_layernorm",
                       ".post_attention_layernorm"):
            names[prefix + suffix] = None
        for module in SUPPORTED_MODULES:
            names[f"{prefix}.{block_of(module)}.{module}"] = (layer, module)
    return names


@dataclass(frozen=True)
class TargetSpec:
    """The fields of adapter_config.json that choose the adapted modules."""

    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, config: dict[str, Any]) -> TargetSpec:
        targets = config.get("target_modules")
        if targets is None:
            raise AdapterError("target_modules is missing from adapter_config.json")
        spec = cls(
            target_modules=_names_or_pattern(targets, "target_modules"),
            exclude_modules=None if not config.get("exclude_modules") else _names_or_pattern(
                config["exclude_modules"], "exclude_modules"),
            layers_to_transform=_layers(config.get("layers_to_transform")),
            layers_pattern=_patterns(config.get("layers_pattern")),
        )
        if isinstance(spec.target_modules, tuple):
            unsupported = sorted({t.rsplit(".", 1)[-1] for t in spec.target_modules} - set(SUPPORTED_MODULES))
            if unsupported:
                raise AdapterError(f"unsupported target modules: {', '.join(unsupported)}; "
                                   f"supported: {', '.join(SUPPORTED_MODULES)}")
        return spec

    def describe(self) -> str:
        if isinstance(self.target_modules, str):
            return f"target_modules {self.target_modules!r}"
        return f"target_modules [{', '.join(self.target_modules)}]"

    def select(self, num_layers: int) -> set[tuple[int, str]]:
        """The (layer, projection) pairs PEFT adapts in a model of `num_layers` layers.
        AdapterError if the config selects a module loraplex cannot adapt, or none."""
        deadline = time.monotonic() + MATCH_TIME_LIMIT_S
        selected: set[tuple[int, str]] = set()
        for name, projection in module_names(num_layers).items():
            if not self._selects(name, deadline):
                continue
            if projection is None:
                leaf = name.rsplit(".", 1)[-1]
                raise AdapterError(
                    f"{self.describe()} selects {name}, which loraplex cannot adapt (unsupported "
                    f"target module {leaf!r}; supported: {', '.join(SUPPORTED_MODULES)})")
            selected.add(projection)
        if not selected:
            raise AdapterError(f"{self.describe()} selects no module of the base model (names "
                               f"look like model.layers.0.self_attn.q_proj)")
        return selected

    def _selects(self, name: str, deadline: float) -> bool:
        if self.exclude_modules is not None and _matches(self.exclude_modules, name, deadline):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules.lower() == ALL_LINEAR:  # PEFT: every linear layer but lm_head
                return name.startswith("model.layers.") and name.rsplit(".", 1)[-1] in SUPPORTED_MODULES
            return _fullmatch(self.target_modules, name, deadline)
        if name in self.target_modules:
            return True  # PEFT: an exact name is never restricted by layers_to_transform
        if not _matches(self.target_modules, name, deadline):
            return False
        if self.layers_to_transform is None:
            return True
        layer = self._layer_of(name, deadline)
        return layer is not None and layer in self.layers_to_transform

    def _layer_of(self, name: str, deadline: float) -> int | None:
        if not self.layers_pattern:
            found = _match(r".*?\.[^.]*\.(\d+)\.", name, deadline)
            return None if found is None else int(found.group(1))
        for pattern in self.layers_pattern:
            found = _match(rf"(?:^|.*?\.){pattern}\.(\d+)\.", name, deadline)
            if found is not None:
                return int(found.group(1))
        return None


def _matches(spec: tuple[str, ...] | str, name: str, deadline: float) -> bool:
    if isinstance(spec, str):
        return _fullmatch(spec, name, deadline)
    return name in spec or any(name.endswith("." + entry) for entry in spec)


def _fullmatch(pattern: str, name: str, deadline: float) -> bool:
    try:
        return regex.fullmatch(pattern, name, timeout=_remaining(deadline, pattern)) is not None
    except regex.error as exc:
        raise AdapterError(f"{pattern!r} is not a valid regular expression ({exc})") from None
    except TimeoutError:
        raise AdapterError(f"the pattern {pattern!r} takes too long to match module names") from None


def _match(pattern: str, name: str, deadline: float) -> Any:
    try:
        return regex.match(pattern, name, timeout=_remaining(deadline, pattern))
    except regex.error as exc:
        raise AdapterError(f"layers_pattern makes {pattern!r}, not a valid regular expression "
                           f"({exc})") from None
    except TimeoutError:
        raise AdapterError(f"layers_pattern {pattern!r} takes too long to match module names") from None


def _remaining(deadline: float, pattern: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise AdapterError(f"the pattern {pattern[:MAX_PATTERN_LENGTH]!r} takes too long to match "
                           f"module names")
    return left


def _names_or_pattern(value: Any, what: str) -> tuple[str, ...] | str:
    if isinstance(value, str):
        if len(value) > MAX_PATTERN_LENGTH:
            raise AdapterError(f"{what} is longer than {MAX_PATTERN_LENGTH} characters")
        return value
    if (not isinstance(value, list) or len(value) > MAX_ENTRIES
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_PATTERN_LENGTH for t in value)):
        raise AdapterError(f"{what} must be a regular expression or a list of at most "
                           f"{MAX_ENTRIES} module names")
    return tuple(value)


def _layers(value: Any) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    values = [value] if isinstance(value, int) else value
    if (not isinstance(values, list) or len(values) > 4096
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)):
        raise AdapterError("layers_to_transform must be a layer index or a list of them")
    return tuple(values)


def _patterns(value: Any) -> tuple[str, ...] | None:
    if value is None or value == [] or value == "":
        return None
    values = [value] if isinstance(value, str) else value
    if (not isinstance(values, list) or len(values) > MAX_ENTRIES
            or not all(isinstance(v, str) and 0 < len(v) <= MAX_PATTERN_LENGTH for v in values)):
        raise AdapterError("layers_pattern must be a name or a list of names")
    return tuple(values)
