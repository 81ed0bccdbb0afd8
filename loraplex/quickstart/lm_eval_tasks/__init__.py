"""lm-eval tasks on the quick start's held-out test sets, one per adapter (`loraplex_pirate`,
`loraplex_extract`, `loraplex_sentiment`, all three under the tag `loraplex_quickstart`), scored
by each task's own rule; generation through `local-chat-completions` with the chat template. The
folder is lm-eval's `--include_path` (`python -m loraplex.quickstart.lm_eval_tasks` prints it)."""

from pathlib import Path

TASKS_DIR = Path(__file__).parent
"""The folder that holds the task YAML files."""
