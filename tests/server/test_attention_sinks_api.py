"""`streaming_window` (attention sinks) on the OpenAI-compatible API: a completion runs past the
model's context through the openai client's extra_body; bad windows are 400s naming the field."""

from __future__ import annotations

from tests.server.server_support import MODEL_ID, Server

BAD_WINDOWS = [
    ({"sliding_window": 0}, "streaming_window.sliding_window", "invalid_value"),
    ({"sliding_window": 64, "attention_sinks": -1}, "streaming_window.attention_sinks", "invalid_value"),
    ({"attention_sinks": 4}, "streaming_window.sliding_window", "missing_required_parameter"),
    ({"sliding_window": 64, "sinks": 4}, "streaming_window.sinks", "unknown_parameter"),
    (64, "streaming_window", "invalid_value"),
]


def test_a_completion_with_sinks_runs_past_the_context(sqlite_server: Server) -> None:
    context = 512  # the test engine's max_model_len
    completion = sqlite_server.openai("acme").completions.create(
        model=MODEL_ID, prompt="hi", max_tokens=context + 88, temperature=0,
        extra_body={"streaming_window": {"sliding_window": 96, "attention_sinks": 4}, "ignore_eos": True})
    assert completion.usage.completion_tokens == context + 88
    assert completion.choices[0].finish_reason == "length"


def test_bad_windows_are_400_naming_the_field(sqlite_server: Server) -> None:
    with sqlite_server.http(sqlite_server.keys["acme"]) as http:
        for window, param, code in BAD_WINDOWS:
            response = http.post("/v1/completions", json={
                "model": MODEL_ID, "prompt": "hi", "max_tokens": 4, "streaming_window": window})
            assert response.status_code == 400, (window, response.text)
            error = response.json()["error"]
            assert (error["param"], error["code"]) == (param, code), (window, error)
        response = http.post("/v1/chat/completions", json={  # a window the cache cannot hold
            "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}],
            "streaming_window": {"sliding_window": 600}})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "streaming_window", response.text
        assert "make the window at most 480" in error["message"]
        response = http.post("/v1/completions", json={  # without a window, max_tokens stays in the context
            "model": MODEL_ID, "prompt": "hi", "max_tokens": 600})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
