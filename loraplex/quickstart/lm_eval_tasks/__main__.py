"""`python -m loraplex.quickstart.lm_eval_tasks`: print the task folder, for lm-eval's --include_path."""

from loraplex.quickstart.lm_eval_tasks import TASKS_DIR

print(TASKS_DIR)
