"""Wire details the official SDKs check: top_logprobs best first with the chosen token's
entry exact, SentencePiece token texts that join to the text, no literal special tokens
unless asked, Anthropic stop_sequence / count_tokens / models.list, /openapi.json."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from engine.serve.server import ROUTES

from .conftest import API_KEY

HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_top_logprobs_best_first_and_the_chosen_entry_exact(client):
    r = client.chat.completions.create(
        model="tiny-chat", messages=HELLO, max_tokens=8, logprobs=True, top_logprobs=5, **GREEDY
    )
    for entry in r.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the best one, with the very same number.
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob


def test_special_tokens_are_left_out_unless_asked(client):
    specials = ("<|endoftext|>", "<|im_start|>")
    for seed in range(20):  # a random model writes a special token within a few seeds
        kw = {"model": "tiny-chat", "prompt": "hello", "max_tokens": 40, "temperature": 1.5, "seed": seed}
        shown = client.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0].text
        if any(s in shown for s in specials):
            break
    else:
        pytest.fail("no seed wrote a special token")
    hidden = client.completions.create(**kw).choices[0].text
    chat = client.chat.completions.create(
        model="tiny-chat", messages=HELLO, max_tokens=40, temperature=1.5, seed=seed
    ).choices[0]
    expected = shown
    for s in specials:
        expected = expected.replace(s, "")
    assert hidden == expected
    assert not any(s in (chat.message.content or "") for s in specials)


def test_anthropic_stop_sequences_say_which_one(claude):
    whole = claude.messages.create(model="tiny-chat", max_tokens=24, messages=HELLO, extra_body=GREEDY)
    text = whole.content[0].text
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    stop = text[6:8]
    cut = claude.messages.create(
        model="tiny-chat", max_tokens=24, messages=HELLO, stop_sequences=["never written", stop], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == text[: text.index(stop)]
    with claude.messages.stream(
        model="tiny-chat", max_tokens=24, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY
    ) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_anthropic_count_tokens_is_the_prompt_the_model_reads(claude):
    system = "You are terse."
    counted = claude.messages.count_tokens(model="tiny-chat", system=system, messages=HELLO)
    used = claude.messages.create(model="tiny-chat", max_tokens=1, system=system, messages=HELLO)
    assert counted.input_tokens == used.usage.input_tokens + used.usage.cache_read_input_tokens > 0


def test_models_in_both_clients_shapes(client, claude):
    [listed] = claude.models.list().data
    assert listed.id == "tiny-chat" and listed.type == "model" and listed.display_name == "tiny-chat"
    assert claude.models.retrieve("tiny-chat").id == "tiny-chat"
    assert client.models.retrieve("tiny-chat").owned_by == "mlx-desk"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_openapi_document_describes_every_endpoint(server):
    with urllib.request.urlopen(server.base + "/openapi.json", timeout=30) as r:
        doc = json.loads(r.read())
    assert doc["openapi"].startswith("3.")
    paths = {p.replace("{model_id}", "*") for p in doc["paths"]}
    assert paths == {path for _, path in ROUTES}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert (method.upper(), path.replace("{model_id}", "*")) in ROUTES
            assert "200" in op["responses"]
    # The request schemas take what the server takes and refuse what it refuses.
    schemas = doc["components"]["schemas"]

    def valid(name: str, body: dict) -> bool:
        schema = {**schemas[name], "components": doc["components"]}
        return jsonschema.validators.Draft202012Validator(schema).is_valid(body)

    assert valid("CompletionRequest", {"model": "tiny-chat", "prompt": [[1, 2], "text"], "max_tokens": 0, "echo": True})
    assert not valid("CompletionRequest", {"model": "tiny-chat", "prompt": [], "max_tokens": 0})
    assert not valid("CompletionRequest", {"model": "tiny-chat", "prompt": [-1]})
    assert valid("ChatRequest", {"model": "tiny-chat", "messages": HELLO, "n": 2, "top_logprobs": 3})
    assert not valid("ChatRequest", {"model": "tiny-chat", "messages": HELLO, "temperature": 3})
    assert not valid("MessagesRequest", {"model": "tiny-chat", "messages": HELLO})  # max_tokens is required
    assert not valid("ChatRequest", {"model": "gpt-4", "messages": HELLO})  # only the loaded model's names
    refs = json.dumps(doc).count('"$ref"')
    assert refs and all(
        name in doc["components"]["schemas"] for name in ("ChatRequest", "CompletionRequest", "MessagesRequest")
    )
