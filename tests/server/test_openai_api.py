"""The OpenAI-compatible API through the official `openai` client against a real uvicorn
server, on SQLite and on PostgreSQL: completions, chat, streaming, models, tenant isolation,
keys, parameter errors, adapters found and dropped without a restart, usage."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.server_support import MODEL_ID, Server

GREEDY = {"temperature": 0, "max_tokens": 8}
JSON = {"content-type": "application/json"}


def test_models_lists_the_base_model_and_only_the_callers_adapters(server: Server) -> None:
    models = server.openai("acme").models.list().data
    assert [m.id for m in models] == [MODEL_ID, "shared", "style"]
    base, *adapters = models
    assert base.parent is None and base.owned_by == "loraplex"
    assert all(m.parent == MODEL_ID and m.owned_by == "acme" for m in adapters)
    assert "/" not in json.dumps([m.model_dump() for m in models]).replace("\\/", "")  # no paths
    assert [m.id for m in server.openai("globex").models.list().data] == [MODEL_ID, "shared"]
    assert server.openai("acme").models.retrieve("style").parent == MODEL_ID


def test_completion_with_base_model_and_adapters(server: Server) -> None:
    client = server.openai("acme")
    base = client.completions.create(model=MODEL_ID, prompt="Hello there", **GREEDY)
    again = client.completions.create(model=MODEL_ID, prompt="Hello there", **GREEDY)
    styled = client.completions.create(model="style", prompt="Hello there", **GREEDY)
    (choice,) = base.choices
    assert choice.finish_reason == "length" and base.model == MODEL_ID and styled.model == "style"
    assert base.object == "text_completion" and base.id.startswith("cmpl-")
    assert choice.text == again.choices[0].text  # greedy is deterministic
    assert styled.choices[0].text != choice.text  # the adapter changes the output
    prompt_tokens = len(b"Hello there")  # a byte-level tokenizer, no BOS added
    assert (base.usage.prompt_tokens, base.usage.completion_tokens, base.usage.total_tokens) == (
        prompt_tokens, 8, prompt_tokens + 8)
    seeded = [client.completions.create(model="style", prompt="Hi", max_tokens=6, seed=7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    by_ids = client.completions.create(model=MODEL_ID, prompt=[1, 50, 60], **GREEDY)
    assert by_ids.usage.prompt_tokens == 3


def test_chat_uses_the_chat_template(server: Server) -> None:
    client = server.openai("acme")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model="shared", messages=messages, **GREEDY)
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    rendered = "<s><|system|>Be brief.\n<|user|>Hi!\n<|assistant|>"  # CHAT_TEMPLATE; <s> is one token
    assert chat.usage.prompt_tokens == len(rendered.encode()) - len("<s>") + 1
    same = client.completions.create(model="shared", prompt=rendered, **GREEDY)
    assert same.usage.prompt_tokens == chat.usage.prompt_tokens
    assert same.choices[0].text == choice.message.content
    developer = [{"role": "developer", "content": "Be brief."}, messages[1]]
    assert client.chat.completions.create(model="shared", messages=developer, **GREEDY
                                          ).choices[0].message.content == choice.message.content


def test_streams_match_whole_answers_and_end_with_usage(server: Server) -> None:
    client = server.openai("acme")
    whole = client.completions.create(model="style", prompt="Stream me", **GREEDY)
    chunks = list(client.completions.create(model="style", prompt="Stream me", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks) and usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump() | {
        "completion_tokens_details": None, "prompt_tokens_details": None}
    assert len({c.id for c in chunks}) == 1

    messages = [{"role": "user", "content": "Stream a chat"}]
    whole_chat = client.chat.completions.create(model="shared", messages=messages, **GREEDY)
    stream = list(client.chat.completions.create(model="shared", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        whole_chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    assert stream[-1].choices == [] and stream[-1].usage.total_tokens == whole_chat.usage.total_tokens

    with server.http(server.keys["acme"]) as http, http.stream(
            "POST", "/v1/chat/completions", json={"model": MODEL_ID, "messages": messages,
                                                  "stream": True, **GREEDY}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])  # not asked for


def test_logprobs(server: Server) -> None:
    client = server.openai("acme")
    completion = client.completions.create(model=MODEL_ID, prompt="abc", logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert "".join(logprobs.tokens) == completion.choices[0].text or "\ufffd" in completion.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-4
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_echo_scores_the_prompt_as_generation_scored_it(server: Server) -> None:
    """What lm-eval's likelihood tasks send: `echo` + `logprobs`, `max_tokens` 0 or 1. A token
    scored as part of the prompt (prefill) gets the log-probability that generation (decode)
    gave it as an alternative, under the same adapter."""
    client = server.openai("acme")
    generated = client.completions.create(model="style", prompt="abc", logprobs=20, temperature=0,
                                          max_tokens=1)
    alternatives = generated.choices[0].logprobs.top_logprobs[0]
    candidates = [t for t in alternatives if len(t) == 1 and t.isascii() and t.isalnum()]
    assert candidates, alternatives
    for candidate in candidates[:3]:
        scored = client.completions.create(model="style", prompt="abc" + candidate, echo=True, logprobs=2,
                                           max_tokens=0)
        (choice,) = scored.choices
        logprobs = choice.logprobs
        assert choice.text == "abc" + candidate and scored.usage.completion_tokens == 0
        assert logprobs.tokens == ["a", "b", "c", candidate] and choice.finish_reason == "length"
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert abs(logprobs.token_logprobs[3] - alternatives[candidate]) < 1e-4
        assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
        assert logprobs.text_offset == [0, 1, 2, 3]  # the byte tokenizer adds no BOS
    top_token = max(alternatives, key=alternatives.get)
    with_next = client.completions.create(model="style", prompt="abc", echo=True, logprobs=1, max_tokens=1,
                                          temperature=0)
    (choice,) = with_next.choices
    assert choice.text == "abc" + generated.choices[0].text and len(choice.logprobs.tokens) == 4
    assert choice.logprobs.top_logprobs[-1] == {top_token: alternatives[top_token]}
    # lm-eval's greedy check compares a token's logprob with the best alternative's, exactly
    assert choice.logprobs.token_logprobs[-1] == max(choice.logprobs.top_logprobs[-1].values())
    base = client.completions.create(model=MODEL_ID, prompt="abc", echo=True, logprobs=0, max_tokens=0)
    assert base.choices[0].logprobs.token_logprobs[1:] != choice.logprobs.token_logprobs[1:3]  # the adapter
    echoed = list(client.completions.create(model="style", prompt="abc", echo=True, stream=True, logprobs=0,
                                            **GREEDY))
    assert echoed[0].choices[0].text.startswith("abc")
    assert echoed[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in echoed) == client.completions.create(
        model="style", prompt="abc", echo=True, **GREEDY).choices[0].text


def test_vllm_prompt_logprobs(server: Server) -> None:
    client = server.openai("acme")
    completion = client.completions.create(model="shared", prompt="hello", max_tokens=0,
                                           extra_body={"prompt_logprobs": 2})
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len("hello")
    for entry, ch in zip(entries[1:], "ello"):
        own = [e for e in entry.values() if e["decoded_token"] == ch]
        assert len(own) == 1 and own[0]["logprob"] <= 0 and own[0]["rank"] >= 1
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and len(entry) in (2, 3)  # the top 2, and the token if not among them
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="shared", messages=messages, max_tokens=0,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and chat.choices[0].message.content == ""
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="shared", messages=messages, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert caught.value.param == "prompt_logprobs"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: Server) -> None:
    """As vLLM does, and as guidellm asks."""
    client = server.openai("acme")
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model="style", prompt="count", stream=True,
                                            stream_options=options, **GREEDY))
    *text_chunks, last = chunks
    counts = [c.usage.completion_tokens for c in text_chunks]  # a chunk may carry several tokens' text
    assert counts == sorted(set(counts)) and counts[0] >= 1 and counts[-1] == 8
    assert all(c.usage.prompt_tokens == len(b"count") for c in chunks) and last.choices == []
    assert last.usage.completion_tokens == 8
    messages = [{"role": "user", "content": "count"}]
    chat = list(client.chat.completions.create(model="style", messages=messages, stream=True,
                                               stream_options={"continuous_usage_stats": True}, **GREEDY))
    completion_tokens = [c.usage.completion_tokens for c in chat]
    assert completion_tokens[0] == 0 and completion_tokens[-1] == 8 and completion_tokens == sorted(
        completion_tokens)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="style", messages=messages, stream=True, stream_options={
            "include_usage": False, "continuous_usage_stats": True}, **GREEDY)
    assert caught.value.param == "stream_options"


def test_vllm_extensions_with_their_meaning(server: Server) -> None:
    client = server.openai("acme")
    whole = client.completions.create(model="style", prompt="abcdef", temperature=0, max_tokens=30,
                                      logprobs=0)
    tokens = whole.choices[0].logprobs.tokens
    index = next(i for i, t in enumerate(tokens) if len(t) == 1 and t.isascii() and t.isalnum())
    from tokenizers import pre_tokenizers

    stop_id = 3 + sorted(pre_tokenizers.ByteLevel.alphabet()).index(tokens[index])  # the byte tokenizer's id
    stopped = client.completions.create(model="style", prompt="abcdef", temperature=0, max_tokens=30,
                                        extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == index + 1
    cut = client.completions.create(model="style", prompt="zzzzabcdef", extra_body={
        "truncate_prompt_tokens": 6}, **GREEDY)
    assert cut.usage.prompt_tokens == 6
    neutral = {"min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0.0, "use_beam_search": False,
               "length_penalty": 1.0, "include_stop_str_in_output": False, "skip_special_tokens": True,
               "spaces_between_special_tokens": True, "priority": 0, "top_k": -1, "ignore_eos": False,
               "add_special_tokens": True}
    assert client.completions.create(model="style", prompt="abcdef", extra_body=neutral, temperature=0,
                                     max_tokens=30).choices[0].text == whole.choices[0].text


def test_n_choices_are_samples_each_as_a_request_of_its_own_seed(server: Server) -> None:
    """n choices: choice i is the sample a single request with seed + i gives; the usage counts
    the prompt once and every choice's completion."""
    client = server.openai("acme")
    kwargs = dict(model="style", prompt="tell me a tale", max_tokens=8, temperature=0.9,
                  extra_body={"ignore_eos": True})
    many = client.completions.create(n=3, seed=40, **kwargs)
    single = [client.completions.create(seed=40 + i, **kwargs) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in single]
    assert len({c.text for c in many.choices}) > 1  # samples, not copies
    assert many.usage.prompt_tokens == single[0].usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * 8
    chat = dict(model="style", messages=[{"role": "user", "content": "a tale"}], max_tokens=6,
                temperature=0.9, seed=7, n=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 12
    texts = {0: "", 1: ""}
    roles, finished, usage = set(), set(), None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles.update([choice.index] if choice.delta.role else [])
            texts[choice.index] += choice.delta.content or ""
            finished.update([choice.index] if choice.finish_reason else [])
    assert roles == finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_tenants_cannot_see_or_use_each_others_adapters(server: Server) -> None:
    globex = server.openai("globex")
    for call in (lambda: globex.models.retrieve("style"),
                 lambda: globex.completions.create(model="style", prompt="x", max_tokens=2),
                 lambda: globex.chat.completions.create(model="style", max_tokens=2,
                                                        messages=[{"role": "user", "content": "x"}]),
                 lambda: globex.completions.create(model="no-such-adapter", prompt="x", max_tokens=2),
                 lambda: globex.completions.create(model="nul\x00name", prompt="x", max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "model_not_found" and caught.value.body["param"] == "model"
    # Both have an adapter named `shared`: each gets its own.
    acme = server.openai("acme").completions.create(model="shared", prompt="same", **GREEDY)
    own = globex.completions.create(model="shared", prompt="same", **GREEDY)
    assert acme.choices[0].text != own.choices[0].text


def test_bad_keys_are_refused(server: Server) -> None:
    for key in ("lpx-" + "x" * 43, "not-a-key"):
        with pytest.raises(openai.AuthenticationError) as caught:
            server.openai(key=key).models.list()
        assert caught.value.code == "invalid_api_key" and caught.value.status_code == 401
    response = httpx.get(f"{server.url}/v1/models", timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError):  # an admin key is not a tenant key
        server.openai(key=server.admin_key).models.list()
    with server.http(server.keys["acme"]) as http:  # nor a tenant key an admin key
        assert http.get("/admin/api/tenants").status_code == 403
    (key,) = [k for k in server.registry.keys.list(tenant="globex")]
    server.registry.keys.revoke(key.id)
    _eventually_raises(openai.AuthenticationError, lambda: server.openai("globex").models.list())


BAD_PARAMETERS = [
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": -3}, "max_tokens", "invalid_value"),
    ({"max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ({"max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ({"temperature": -0.5}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"n": 17}, "n", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"stop": ["a"] * 17}, "stop", "invalid_value"),
    ({"logprobs": 21}, "logprobs", "invalid_value"),
    ({"echo": 3}, "echo", "invalid_value"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens", "invalid_value"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
    ({"stop_token_ids": [300]}, "stop_token_ids", "invalid_value"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
    ({"repetition_penalty": 1.2}, "repetition_penalty", "invalid_value"),
    ({"min_tokens": 3}, "min_tokens", "invalid_value"),
    ({"min_p": 0.1}, "min_p", "invalid_value"),
    ({"use_beam_search": True}, "use_beam_search", "invalid_value"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "invalid_grammar"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "unknown_parameter"),
    ({"logits_processors": ["x"]}, "logits_processors", "unknown_parameter"),
    ({"presence_penalty": 0.5}, "presence_penalty", "invalid_value"),
    ({"best_of": 3}, "best_of", "invalid_value"),
    ({"prompt": "x" * 600}, "prompt", "context_length_exceeded"),
    ({"prompt": ["a", "b"]}, "prompt", "invalid_value"),
    ({"prompt": [1, 99999]}, "prompt", "invalid_request"),
    ({"max_token": 5}, "max_token", "unknown_parameter"),
    ({"model": None}, "model", "missing_required_parameter"),
]


def test_bad_parameters_are_400_naming_the_parameter(server: Server) -> None:
    with server.http(server.keys["acme"]) as http:
        for change, param, code in BAD_PARAMETERS:
            body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 4} | change
            body = {k: v for k, v in body.items() if v is not None}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 400, (change, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (change, error)
            assert error["code"] == code, (change, error)
        chat_cases = [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]},
                                                       "messages.0.role"),
                      ({"tools": [{"type": "function"}]}, "tools.0.function"),
                      ({"tool_choice": "required"}, "tool_choice"),
                      ({"messages": [{"role": "user", "content": "y" * 600}]}, "messages")]
        for change, param in chat_cases:
            body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]} | change
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        response = http.post("/v1/completions", content=b"{not json", headers=JSON)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as caught:  # and as the client sees it
        server.openai("acme").completions.create(model=MODEL_ID, prompt="x", max_tokens=1, temperature=-1)
    assert caught.value.param == "temperature"


def test_every_response_has_a_request_id_and_bodies_are_capped(server: Server) -> None:
    with server.http(server.keys["acme"]) as http:
        responses = [
            http.get("/v1/models"), http.get("/health"), http.get("/nowhere"),
            http.post("/v1/completions", json={"model": MODEL_ID}),
            httpx.get(f"{server.url}/v1/models"),
            http.post("/v1/completions", content=b"x" * (5 << 20), headers=JSON),
        ]
    assert [r.status_code for r in responses] == [200, 200, 404, 400, 401, 413]
    ids = [r.headers["x-request-id"] for r in responses]
    assert len(set(ids)) == len(ids) and all(len(i) == 24 for i in ids)
    assert all("error" in r.json() for r in responses[2:])
    completion = server.openai("acme").completions.with_raw_response.create(
        model=MODEL_ID, prompt="x", max_tokens=1)
    assert completion.headers["x-request-id"] in completion.parse().id


def test_new_adapters_are_served_without_restart_and_deleted_ones_stop(
        server: Server, adapter_dirs) -> None:
    client = server.openai("globex")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    server.registry.adapters.upload_dir("globex", "late", adapter_dirs["mlp"])  # as the CLI does
    late = _eventually(lambda: client.completions.create(model="late", prompt="same", **GREEDY))
    # Same tensors as acme's `shared`: one identity, the same output.
    assert late.choices[0].text == server.openai("acme").completions.create(
        model="shared", prompt="same", **GREEDY).choices[0].text
    server.registry.adapters.delete("globex", "late")
    _eventually_raises(openai.NotFoundError,
                       lambda: client.completions.create(model="late", prompt="x", max_tokens=2))
    assert server.openai("acme").completions.create(model="shared", prompt="x", max_tokens=2).choices


def test_usage_is_recorded_per_tenant_adapter_and_hour(server: Server) -> None:
    expected: dict[tuple[str, str | None], list[int]] = {}
    for tenant, model in [("acme", "style"), ("acme", MODEL_ID), ("acme", "style"), ("globex", "shared")]:
        usage = server.openai(tenant).completions.create(model=model, prompt="count me", **GREEDY).usage
        counts = expected.setdefault((tenant, None if model == MODEL_ID else model), [0, 0, 0])
        counts[0] += 1
        counts[1] += usage.prompt_tokens
        counts[2] += usage.completion_tokens
    with server.http() as http:
        rows = http.get("/admin/api/usage").json()["rows"]
        acme_rows = http.get("/admin/api/usage", params={"tenant": "acme", "adapter": "style"}).json()
    assert {(r["tenant"], r["adapter"]): [r["num_requests"], r["prompt_tokens"], r["completion_tokens"]]
            for r in rows} == expected
    assert acme_rows["totals"]["num_requests"] == 2
    assert server.registry.adapters.get("acme", "style").num_requests_served == 2


def _eventually(call, timeout_s: float = 5.0):
    """`call()` once the server's registry cache has caught up (its TTL is 0.2 s in tests)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except openai.NotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _eventually_raises(error: type[Exception], call, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            call()
        except error:
            return
        time.sleep(0.05)
    raise AssertionError(f"{error.__name__} was not raised within {timeout_s} s")
