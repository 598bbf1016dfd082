"""Real clients against a running ``python -m engine serve``: the official OpenAI and
Anthropic SDKs and third-party clients from PyPI (llm, langchain-openai, litellm, lm-eval),
each doing what its users do. Prints one line per check (PASS / FAIL / SKIP with the
reason) and exits non-zero when any check fails.

The clients pull in heavy dependencies (lm-eval brings torch), so they live in a venv of
their own, not the project's (docs/server-clients.md gives the commands):

    python -m engine serve --model MODEL_DIR --port 8765 --api-key KEY &
    CLIENTS_VENV/bin/python tests/clients/check_clients.py --base http://127.0.0.1:8765 \\
        --key KEY --tokenizer MODEL_DIR

``--tokenizer`` is a Hugging Face tokenizer folder (the model's own) for lm-eval, which
tokenizes requests itself. Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path

RESULTS: list[tuple[str, str, str]] = []
HELLO = [{"role": "user", "content": "hello there"}]


def check(client: str, name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
                RESULTS.append((client, name, "PASS"))
            except ModuleNotFoundError as e:
                RESULTS.append((client, name, f"SKIP ({e.name} is not installed)"))
            except Exception as e:  # noqa: BLE001 - every failure is reported, the rest still run
                detail = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]
                RESULTS.append((client, name, f"FAIL {detail[:300]}"))

        run.__name__ = fn.__name__
        CHECKS.append(run)
        return run

    return wrap


CHECKS: list[Callable[[], None]] = []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="http://127.0.0.1:8765", help="the server's address (loopback only)")
    parser.add_argument("--key", default="none", help="the server's --api-key")
    parser.add_argument("--tokenizer", help="the model folder, for lm-eval's tokenizer")
    args = parser.parse_args()
    if not args.base.startswith(("http://127.0.0.1:", "http://localhost:", "http://[::1]:")):
        parser.error("--base must be a loopback address")
    global BASE, KEY, TOKENIZER, MODEL
    BASE, KEY, TOKENIZER = args.base.rstrip("/"), args.key, args.tokenizer
    req = urllib.request.Request(BASE + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        MODEL = json.loads(r.read())["data"][0]["id"]
    for run in CHECKS:
        run()
    width = max(len(f"{c} / {n}") for c, n, _ in RESULTS)
    for client, name, outcome in RESULTS:
        print(f"{f'{client} / {name}':<{width}}  {outcome}")
    failed = [r for r in RESULTS if r[2].startswith("FAIL")]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks did not fail ({len(failed)} failed)")
    return 1 if failed else 0


BASE = KEY = MODEL = ""
TOKENIZER: str | None = None


# ---- the official SDKs ---------------------------------------------------------------------


def _openai():
    import openai

    return openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _anthropic():
    import anthropic

    return anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


@check("openai", "chat, stream, n=2, logprobs")
def openai_chat() -> None:
    c = _openai()
    whole = c.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, n=2, logprobs=True, top_logprobs=2
    )
    assert len(whole.choices) == 2 and whole.choices[0].message.content == whole.choices[1].message.content
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True)
        if ch.choices
    )
    assert streamed == whole.choices[0].message.content


@check("openai", "completions echo + logprobs + max_tokens 0, batch")
def openai_completions() -> None:
    c = _openai()
    out = c.completions.create(model=MODEL, prompt=["hello there", "the cat"], max_tokens=0, echo=True, logprobs=1)
    assert [ch.text for ch in out.choices] == ["hello there", "the cat"]
    assert out.choices[0].logprobs.token_logprobs[0] is None


@check("openai", "errors are typed")
def openai_errors() -> None:
    import openai

    try:
        _openai().chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    except openai.BadRequestError:
        return
    raise AssertionError("an empty message list was accepted")


@check("anthropic", "messages, stream, stop_sequences")
def anthropic_messages() -> None:
    c = _anthropic()
    whole = c.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body={"temperature": 0})
    text = whole.content[0].text
    stop = text[4:6]
    cut = c.messages.create(
        model=MODEL, max_tokens=16, messages=HELLO, stop_sequences=[stop], extra_body={"temperature": 0}
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    with c.messages.stream(model=MODEL, max_tokens=16, messages=HELLO, extra_body={"temperature": 0}) as s:
        assert s.get_final_message().content[0].text == text


@check("anthropic", "count_tokens, models.list")
def anthropic_misc() -> None:
    c = _anthropic()
    assert c.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    assert [m.id for m in c.models.list().data] == [MODEL]


# ---- third-party clients -------------------------------------------------------------------


@check("llm", "prompt through extra-openai-models.yaml")
def llm_prompt() -> None:
    home = tempfile.mkdtemp(prefix="llm-home-")
    Path(home, "extra-openai-models.yaml").write_text(
        f"- model_id: local\n  model_name: {MODEL}\n  api_base: {BASE}/v1\n  api_key_name: local\n"
    )
    Path(home, "keys.json").write_text(json.dumps({"local": KEY}))
    os.environ["LLM_USER_PATH"] = home
    import llm

    model = llm.get_model("local")
    text = model.prompt("hello there", max_tokens=8, temperature=0).text()
    assert isinstance(text, str) and text
    chunks = list(model.prompt("hello there", max_tokens=8, temperature=0))
    assert "".join(chunks) == text


@check("langchain-openai", "invoke, stream, tool binding")
def langchain_chat() -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=BASE + "/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=8, max_retries=0)
    text = chat.invoke("hello there").content
    assert text and "".join(ch.content for ch in chat.stream("hello there")) == text

    def get_time(city: str) -> str:
        """The time in a city."""
        return "noon"

    reply = chat.bind_tools([get_time]).invoke("what time is it in Paris?")
    assert reply.content is not None  # a tiny random model may or may not call it; the round trip must hold


@check("litellm", "openai/ and anthropic/ providers, text_completion")
def litellm_calls() -> None:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # its bundled price list: no download
    import litellm

    kw = {"api_base": BASE + "/v1", "api_key": KEY, "max_tokens": 8, "temperature": 0}
    text = litellm.completion(model=f"openai/{MODEL}", messages=HELLO, **kw).choices[0].message.content
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in litellm.completion(model=f"openai/{MODEL}", messages=HELLO, stream=True, **kw)
    )
    assert text and streamed == text
    done = litellm.text_completion(model=f"text-completion-openai/{MODEL}", prompt="hello there", **kw)
    assert done.choices[0].text
    claude = litellm.completion(model=f"anthropic/{MODEL}", messages=HELLO, api_base=BASE, api_key=KEY, max_tokens=8)
    assert claude.choices[0].message.content


@check("lm-eval", "local-completions loglikelihood (echo logprobs)")
def lm_eval_loglikelihood() -> None:
    if not TOKENIZER:
        raise ModuleNotFoundError(name="--tokenizer (a model folder)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=BASE + "/v1/completions",
        model=MODEL,
        tokenizer_backend="huggingface",
        tokenizer=TOKENIZER,
        batch_size=4,
        max_retries=1,
    )
    os.environ.setdefault("OPENAI_API_KEY", KEY)
    pairs = [
        ("the quick brown", " fox"),
        ("hello", " there"),
        ("a model is", " a function"),
        ("paris is", " the capital"),
    ]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    assert len(results) == len(pairs) and all(math.isfinite(lp) and lp < 0 for lp, _ in results)
    # The same sums from the server's own scoring of each whole text, tokenized as lm-eval
    # does (the whole text, the continuation being what follows the context's tokens).
    c = _openai()
    for (ctx, cont), (lp, _) in zip(pairs, results, strict=True):
        whole_ids, ctx_ids = lm.tok_encode(ctx + cont), lm.tok_encode(ctx)
        whole = c.completions.create(model=MODEL, prompt=whole_ids, max_tokens=0, echo=True, logprobs=0)
        own = sum(whole.choices[0].logprobs.token_logprobs[len(ctx_ids) :])
        assert abs(own - lp) < 1e-4, (ctx, cont, own, lp)


@check("lm-eval", "local-chat-completions generate_until")
def lm_eval_generate() -> None:
    if not TOKENIZER:
        raise ModuleNotFoundError(name="--tokenizer (a model folder)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalChatCompletion

    os.environ.setdefault("OPENAI_API_KEY", KEY)
    lm = LocalChatCompletion(base_url=BASE + "/v1/chat/completions", model=MODEL, tokenizer_backend=None, max_retries=1)
    messages = json.dumps([{"role": "user", "content": "hello there"}])
    from lm_eval.models.api_models import JsonChatStr

    requests = [Instance("generate_until", {}, (JsonChatStr(messages), {"until": ["\n\n"], "max_gen_toks": 8}), 0)]
    [text] = lm.generate_until(requests)
    direct = _openai().chat.completions.create(
        model=MODEL, messages=json.loads(messages), max_tokens=8, temperature=0, stop=["\n\n"]
    )
    assert text == direct.choices[0].message.content, (text, direct.choices[0].message.content)


@check("instructor", "structured output (JSON schema mode)")
def instructor_structured() -> None:
    from typing import Literal

    import instructor
    from pydantic import BaseModel, Field

    class City(BaseModel):  # bounded fields: a tiny random model would otherwise write on to max_tokens
        name: Literal["Paris", "Rome", "Oslo"]
        population: int = Field(ge=0, le=999)

    client = instructor.from_openai(_openai(), mode=instructor.Mode.JSON_SCHEMA)
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "A city, as JSON."}],
        max_tokens=200,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(city, City)


@check("pydantic-ai", "agent run (plain text)")
def pydantic_ai_run() -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE + "/v1", api_key=KEY))
    result = Agent(model, model_settings={"max_tokens": 8, "temperature": 0}).run_sync("hello there")
    assert isinstance(result.output, str)


@check("openai-agents", "Runner on the chat completions model")
def openai_agents_run() -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent anywhere
    client = AsyncOpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0)
    agent = Agent(
        name="local",
        instructions="Answer briefly.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(max_tokens=8, temperature=0),
    )
    result = Runner.run_sync(agent, "hello there")
    assert isinstance(result.final_output, str)


@check("openapi", "/openapi.json is a valid OpenAPI 3.1 document")
def openapi_valid() -> None:
    from openapi_spec_validator import validate

    with urllib.request.urlopen(BASE + "/openapi.json", timeout=30) as r:
        validate(json.loads(r.read()))


@check("schemathesis", "fuzzing from /openapi.json: no 5xx, server still up")
def schemathesis_fuzz() -> None:
    import shutil
    import subprocess

    st = shutil.which("st") or str(Path(sys.executable).with_name("st"))
    if not Path(st).exists():
        raise ModuleNotFoundError(name="schemathesis")
    run = subprocess.run(
        [st, "run", BASE + "/openapi.json", "-H", f"Authorization: Bearer {KEY}", "--checks", "not_a_server_error",
         "--phases", "fuzzing,stateful", "--max-examples", "12", "--request-timeout", "60", "--workers", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-1500:]
    with urllib.request.urlopen(BASE + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"


if __name__ == "__main__":
    sys.exit(main())
