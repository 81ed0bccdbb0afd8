"""The field's own clients, unchanged, against a real server on the tiny model, with data made
here and nothing downloaded: guidellm (its CLI, constant rate, synthetic prompts from our
tokenizer) and lm-evaluation-harness (`local-completions` and `local-chat-completions`: a
multiple-choice task scored from the prompt's log-probabilities, and a generation task)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.server_support import Server

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GUIDELLM_WORKERS = {"GUIDELLM__MAX_WORKER_PROCESSES": "2"}
"""guidellm spawns up to 10 worker processes by default, each importing its stack: on two cores
their start costs far more than 5 requests a second need."""


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_constant_rate_has_no_errors(sqlite_server: Server, model_dir: Path, tmp_path: Path,
                                              request_format: str) -> None:
    report = tmp_path / "guidellm.json"
    backend = (f"kind=openai_http,target={sqlite_server.url},model=style,"
               f"api_key={sqlite_server.keys['acme']},request_format={request_format}")
    command = [
        str(Path(sys.executable).with_name("guidellm")), "run", "--backend", backend,
        "--profile", "kind=constant,rate=5", "--constraint", "kind=max_duration,seconds=3",
        "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=6",
        "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
        "--output", f"kind=json,path={report}", "--disable-console-interactive",
    ]
    done = subprocess.run(command, env=os.environ | OFFLINE | GUIDELLM_WORKERS, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    requests = benchmark["requests"]
    assert requests["errored"] == [], requests["errored"][:1]
    assert len(requests["successful"]) >= 10  # 5/s for 3 s, less the last ones cut off
    metrics = benchmark["metrics"]
    assert metrics["output_token_count"]["successful"]["median"] == 6  # usage from every chunk
    ttft, itl = (metrics[name]["successful"]["median"] for name in (
        "time_to_first_token_ms", "inter_token_latency_ms"))
    assert 0 < ttft < 5000 and 0 < itl < 5000


def _write_tasks(folder: Path, mc_docs: list[dict], gen_docs: list[dict]) -> Path:
    """A multiple-choice task and a generation task over local JSON lines files."""
    folder.mkdir()
    for name, docs in (("mc", mc_docs), ("gen", gen_docs)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "mc.yaml").write_text(f"""task: loraplex_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (folder / "gen.yaml").write_text(f"""task: loraplex_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return folder


QUESTIONS = ["Which way?", "Pick one:", "The colour is", "Say it", "Answer:", "Go on,", "Next", "Well?"]
CHOICES = ["north", "south", "east", "west"]


def _continuation_logprob(server: Server, model: str, question: str, choice: str) -> float:
    """The continuation's log-likelihood through our API (byte tokenizer: a token a byte)."""
    context = question
    answer = server.openai("acme").completions.create(model=model, prompt=context + " " + choice, echo=True,
                                                      logprobs=1, max_tokens=0)
    return sum(answer.choices[0].logprobs.token_logprobs[len(context.encode()):])


def test_lm_eval_multiple_choice_follows_each_adapters_likelihoods(sqlite_server: Server, model_dir: Path,
                                                                  tmp_path: Path, monkeypatch) -> None:
    """Each question's answer is the choice adapter `style` finds likeliest: lm-eval scores
    `style` 1.0, and `shared` by how often it agrees; its log-likelihoods are ours."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    likelihoods = {model: [[_continuation_logprob(sqlite_server, model, q, c) for c in CHOICES]
                           for q in QUESTIONS] for model in ("style", "shared")}
    answers = [max(range(len(CHOICES)), key=row.__getitem__) for row in likelihoods["style"]]
    agreement = sum(max(range(len(CHOICES)), key=row.__getitem__) == answer
                    for row, answer in zip(likelihoods["shared"], answers)) / len(QUESTIONS)
    assert agreement < 1  # the adapters rank the choices differently somewhere
    mc = [{"question": q, "choices": CHOICES, "answer": a} for q, a in zip(QUESTIONS, answers)]
    gen = [{"question": q, "answer": "north"} for q in QUESTIONS[:3]]
    # Our two tasks only: indexing lm-eval's bundled tasks as well takes seconds.
    tasks = TaskManager(include_path=str(_write_tasks(tmp_path / "tasks", mc, gen)), include_defaults=False)
    for name, value in (OFFLINE | {"OPENAI_API_KEY": sqlite_server.keys["acme"]}).items():
        monkeypatch.setenv(name, value)
    scores = {}
    for model in ("style", "shared"):
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["loraplex_mc", "loraplex_gen"], task_manager=tasks,
            model_args={"model": model, "base_url": f"{sqlite_server.url}/v1/completions",
                        "tokenizer": str(model_dir), "max_retries": 1}, log_samples=True)
        scores[model] = results["results"]["loraplex_mc"]["acc,none"]
        for sample in results["samples"]["loraplex_mc"]:
            theirs = [float(ll) for ll, _ in sample["filtered_resps"]]
            ours = likelihoods[model][sample["doc_id"]]
            assert max(abs(a - b) for a, b in zip(theirs, ours)) < 1e-3
        generations = [s["filtered_resps"][0] for s in results["samples"]["loraplex_gen"]]
        assert len(generations) == 3 and all(isinstance(g, str) for g in generations)
    assert scores == {"style": 1.0, "shared": pytest.approx(agreement)}

    chat = lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=["loraplex_gen"], task_manager=tasks, apply_chat_template=True,
        model_args={"model": "shared", "base_url": f"{sqlite_server.url}/v1/chat/completions",
                    "max_retries": 1}, log_samples=True)
    replies = [s["filtered_resps"][0] for s in chat["samples"]["loraplex_gen"]]
    assert len(replies) == 3 and "exact_match,none" in chat["results"]["loraplex_gen"]
