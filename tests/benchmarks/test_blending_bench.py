"""`loraplex bench blending --smoke` on the CPU (a tiny random model, random documents): both
parts run through the engine's blending path; a full recompute answers as full prefill does,
reuse as is moves the log-probs, and the TTFT part times each way on prompts of 4 documents."""

import json

import pytest

from loraplex.benchmarks.blending import agreement, main, rouge_l


def test_the_smoke_run_measures_quality_and_time_to_first_token(tmp_path):
    main(["--smoke", "--questions", "3", "--doc-tokens", "32", "--answer-tokens", "5", "--ttft-reps", "2",
          "--shares", "0,0.5,1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "blending-cpu.json").read_text())
    quality = result["quality"]
    assert [row["prompt_tokens"] for row in quality["rows"]] == [4 * 32 + 16 + 24] * 3
    full = quality["summary"]["1.0"]
    assert full["identical_answers"] == 3 and full["mean_rouge_l"] == 1.0
    assert full["mean_logprob_error"] < 1e-4
    assert quality["summary"]["0.0"]["mean_first_logprob_error"] > 1e-4  # the documents' KV was reused
    assert sum(row["shares"]["0.0"]["documents_computed"] for row in quality["rows"]) >= 4
    timing = result["ttft"]
    assert timing["prompt_tokens"] == 4 * 32 + 16 + 24
    assert all(len(times) == 2 and min(times) > 0 for times in timing["times_s"].values())
    assert timing["speedup_documents_cached"] > 0
    assert 0 < timing["median_blend_s_documents_cached"] < timing["median_ttft_s"]["blend_documents_cached"]


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--parts", "quality"])
    assert "needs --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--smoke", "--parts", "speed"])
    assert "--parts takes quality and ttft" in capsys.readouterr().err


def test_rouge_l_and_agreement():
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 9, 3], [1, 2, 3]) == pytest.approx(2 / 3)  # LCS 2 of 3 either way
    assert rouge_l([], [1]) == 0.0 and rouge_l([], []) == 1.0
    assert agreement([1, 2, 5], [1, 2, 3, 4]) == 0.5
