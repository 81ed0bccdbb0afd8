"""Registered documents (issue 25): the admin API adds, lists, gets and deletes them, refusing
bad input with the problem named; a request names them (`documents` through the openai client's
`extra_body`), and the answer equals the one to the same text sent in full (the test model has
two layers, so a blend is exact at any share); the engine computes each document's KV once,
whatever order later requests put them in; a prompt that holds a document's text without naming
it is blended alike (`documents_blend: false` turns that off); bad `documents` are 400s naming the
field."""

from __future__ import annotations

import openai
import pytest

from tests.server.server_support import MODEL_ID, Server

GREEDY = {"temperature": 0, "max_tokens": 8}
FAQ = "Orders ship within two business days. Tracking numbers arrive by email. " * 2
POLICY = "Returns are accepted for thirty days with a receipt; refunds take a week. " * 2


def test_admin_api_adds_lists_and_deletes_documents(sqlite_server: Server) -> None:
    with sqlite_server.http() as http:
        added = http.post("/admin/api/documents", json={"tenant": "acme", "name": "faq", "text": FAQ})
        assert added.status_code == 201, added.text
        assert added.json()["num_chars"] == len(FAQ) and added.json()["num_tokens"] == len(FAQ)
        duplicate = http.post("/admin/api/documents", json={"tenant": "acme", "name": "faq", "text": "x"})
        assert duplicate.status_code == 409 and "already has a document named 'faq'" in duplicate.text
        for body, status, reason in (
                ({"tenant": "nobody", "name": "faq", "text": "x"}, 404, "nobody"),
                ({"tenant": "acme", "name": "blank", "text": "  \n"}, 400, "the document is empty"),
                ({"tenant": "acme", "name": "empty", "text": ""}, 400, "text"),
                ({"tenant": "acme", "name": "big", "text": "x" * 200_001}, 400, "text"),
                ({"tenant": "acme", "name": "bad/name", "text": "x"}, 400, "name")):
            refused = http.post("/admin/api/documents", json=body)
            assert refused.status_code == status and reason in refused.text, refused.text
        listed = http.get("/admin/api/documents", params={"tenant": "acme"}).json()
        assert [d["name"] for d in listed] == ["faq"]
        assert http.get("/admin/api/documents/acme/faq").json()["text"] == FAQ
        assert http.delete("/admin/api/documents/acme/faq").status_code == 204
        assert http.get("/admin/api/documents/acme/faq").status_code == 404
        assert http.get("/admin/api/documents").json() == []


def test_requests_name_documents_whose_kv_is_computed_once(sqlite_server: Server, engine) -> None:
    server = sqlite_server
    server.registry.documents.add("acme", "faq", FAQ)
    server.registry.documents.add("acme", "policy", POLICY)
    client = server.openai("acme")
    question = "When will my order arrive?"
    blended_before, computed_before = engine.num_blended_prompts, engine.num_document_prefills
    named = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": question}],
                                           extra_body={"documents": ["faq", "policy"]}, **GREEDY)
    assert engine.num_document_prefills == computed_before + 2
    full = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": question}],
        extra_body={"documents": ["faq", "policy"], "documents_blend": False}, **GREEDY)
    text = FAQ + "\n\n" + POLICY + "\n\n" + question
    sent = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": text}],
                                          **GREEDY)
    answers = {reply.choices[0].message.content for reply in (named, full, sent)}
    assert len(answers) == 1
    assert named.usage.prompt_tokens == sent.usage.prompt_tokens
    # documents_blend: false did not blend; the text sent in full did (its documents found in it)
    assert engine.num_blended_prompts == blended_before + 2
    swapped = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": question}],
        extra_body={"documents": ["policy", "faq"], "documents_recompute_share": 0.5}, **GREEDY)
    assert swapped.choices[0].finish_reason == "length"
    completion = client.completions.create(model=MODEL_ID, prompt=question, extra_body={"documents": ["faq"]},
                                           **GREEDY)
    assert completion.choices[0].finish_reason == "length"
    assert engine.num_document_prefills == computed_before + 2  # reused in another order and place
    assert engine.num_blended_prompts == blended_before + 4


@pytest.mark.parametrize(("extra", "reason"), [
    ({"documents": ["nope"]}, "tenant 'acme' has no document named 'nope'"),
    ({"documents": ["faq", "faq"]}, "document 'faq' is named twice"),
    ({"documents": []}, "documents"),
    ({"documents": ["faq"], "documents_recompute_share": 1.5}, "documents_recompute_share"),
])
def test_bad_documents_are_400(sqlite_server: Server, extra: dict, reason: str) -> None:
    sqlite_server.registry.documents.add("acme", "faq", FAQ)
    with pytest.raises(openai.BadRequestError) as refused:
        sqlite_server.openai("acme").chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], extra_body=extra, **GREEDY)
    assert reason in str(refused.value.body), refused.value.body


MANUAL = "The router restarts when its reset button is held for ten seconds; lights blink amber. " * 2


def test_a_prompt_holding_a_documents_text_reuses_its_kv(sqlite_server: Server, engine) -> None:
    """Found whole in prompts that do not name it, wherever they hold it: computed once, and at
    100% recompute the answer is the full prefill's; not found for another tenant, nor with
    `documents_blend: false`."""
    server = sqlite_server
    server.registry.documents.add("acme", "manual", MANUAL)
    client = server.openai("acme")
    blended, computed = engine.num_blended_prompts, engine.num_document_prefills

    def ask(text: str, tenant_client=client, **extra) -> str:
        reply = tenant_client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": text}], extra_body=extra, **GREEDY)
        return reply.choices[0].message.content

    first = ask(MANUAL + "\n\nHow do I reset it?", documents_recompute_share=1.0)
    assert (engine.num_blended_prompts, engine.num_document_prefills) == (blended + 1, computed + 1)
    assert ask(MANUAL + "\n\nHow do I reset it?", documents_blend=False) == first
    assert engine.num_blended_prompts == blended + 1
    ask("Read this first. " + MANUAL + " What do amber lights mean?")
    assert (engine.num_blended_prompts, engine.num_document_prefills) == (blended + 2, computed + 1)
    ask(MANUAL, tenant_client=server.openai("globex"))  # not globex's document
    ask("How do I reset it?")  # no document in it
    assert engine.num_blended_prompts == blended + 2


def test_documents_blend_under_the_requests_adapter(sqlite_server: Server, engine) -> None:
    """Under an adapter the documents, named or found, are computed once under it (not taken
    from the base model's) and the answer is that adapter's full prefill's."""
    server = sqlite_server
    text = "Warranty claims need the serial number printed under the battery cover, and a receipt. " * 2
    server.registry.documents.add("acme", "warranty", text)
    client = server.openai("acme")

    def ask(model: str, **extra) -> str:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text + "\n\nWhat do I need?"}],
            extra_body=extra, **GREEDY)
        return reply.choices[0].message.content

    base = ask(MODEL_ID)
    blended, computed = engine.num_blended_prompts, engine.num_document_prefills
    styled = ask("style", documents_recompute_share=1.0)
    assert (engine.num_blended_prompts, engine.num_document_prefills) == (blended + 1, computed + 1)
    assert styled == ask("style", documents_blend=False) != base
    ask("style")
    assert (engine.num_blended_prompts, engine.num_document_prefills) == (blended + 2, computed + 1)


def test_another_tenants_document_is_unknown(sqlite_server: Server) -> None:
    sqlite_server.registry.documents.add("acme", "faq", FAQ)
    with pytest.raises(openai.BadRequestError) as refused:
        sqlite_server.openai("globex").chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], extra_body={"documents": ["faq"]},
            **GREEDY)
    assert refused.value.body["param"] == "documents"
