"""The engine CLI as DESIGN.md's contract states it, run as a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tiny_folder_maker():
    """The model-folder writer shared with tests/engine/runtime, loaded by path so this
    module does not depend on how pytest names test packages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cli_tiny_folder", Path(__file__).parent / "runtime" / "tiny_folder.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_model_folder


JSON_KEYS = {
    "text",
    "token_ids",
    "token_logprobs",
    "prompt_tokens",
    "generated_tokens",
    "finish_reason",
    "prompt_tps",
    "generation_tps",
    "peak_memory_bytes",
}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _tiny_folder_maker()(tmp_path_factory.mktemp("cli") / "tiny-llama")


def _one_line_failure(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert err and "\n" not in err, proc.stderr
    assert "Traceback" not in proc.stderr
    return err


def test_golden_stories260k(shared_data):
    """Karpathy's published greedy sample of stories260K, character for character."""
    md = (shared_data / "tiny_llm" / "stories260K.md").read_text()
    # The block after the "$ ./run ... -t 0.0" command line is the greedy sample.
    expected = re.search(r"```\n\$ \./run [^\n]*-t 0\.0\n(.*?)\n```", md, re.S).group(1)
    proc = run(
        "generate",
        "--model",
        str(shared_data / "tiny_llm" / "stories260K.gguf"),
        "--prompt",
        "",
        "--max-tokens",
        "256",
        "--temp",
        "0",
        "--ignore-eos",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == expected


def test_json_contract_and_streaming_agree(model_dir):
    proc = run(
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "10",
        "--ignore-eos",
        "--logprobs",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    assert set(data) == JSON_KEYS
    assert data["generated_tokens"] == len(data["token_ids"]) == len(data["token_logprobs"]) == 10
    assert data["finish_reason"] == "length"
    assert all(lp <= 0 for lp in data["token_logprobs"])
    plain = run(
        "generate", "--model", str(model_dir), "--prompt", "Once upon a time", "--max-tokens", "10", "--ignore-eos"
    )
    assert plain.returncode == 0
    assert plain.stdout == data["text"] + "\n"


def test_prompt_ids_are_fed_as_given(model_dir):
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("Once upon a time")  # with the BOS the tokenizer adds
    a = last_json(
        run(
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ).stdout
    )
    b = last_json(
        run(
            "generate",
            "--model",
            str(model_dir),
            "--prompt-ids",
            ",".join(map(str, ids)),
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ).stdout
    )
    assert a["prompt_tokens"] == b["prompt_tokens"] == len(ids)
    assert a["token_ids"] == b["token_ids"]


def test_chat_wraps_in_template_and_seed_reproduces(model_dir):
    args = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "hello",
        "--chat",
        "--system",
        "be brief",
        "--max-tokens",
        "8",
        "--temp",
        "0.9",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--min-p",
        "0.01",
        "--repetition-penalty",
        "1.1",
        "--seed",
        "5",
        "--json",
    ]
    a, b = last_json(run(*args).stdout), last_json(run(*args).stdout)
    assert a["token_ids"] == b["token_ids"]
    # The prompt is exactly the ChatML the folder's template makes of the two messages: the
    # same ids fed as they are give the same prompt length and the same greedy reply.
    from tokenizers import Tokenizer as HFTokenizer

    expected = "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = HFTokenizer.from_file(str(model_dir / "tokenizer.json")).encode(expected, add_special_tokens=False).ids
    greedy = ["--max-tokens", "8", "--ignore-eos", "--json"]
    chat = last_json(
        run(
            "generate", "--model", str(model_dir), "--prompt", "hello", "--chat", "--system", "be brief", *greedy
        ).stdout
    )
    fed = last_json(run("generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, ids)), *greedy).stdout)
    assert a["prompt_tokens"] == chat["prompt_tokens"] == fed["prompt_tokens"] == len(ids)
    assert chat["token_ids"] == fed["token_ids"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "{missing}", "--prompt", "x"], ""),
        (["--model", "{model}", "--prompt", "x", "--adapter", "{missing}"], "does not exist"),
        (["--model", "{model}", "--prompt", "x", "--ngram", "0"], "--ngram must be at least 1"),
        (["--model", "{model}", "--prompt", "x", "--num-draft", "3"], "needs --draft-model, --ngram or --mtp"),
        (["--model", "{model}", "--prompt", "x", "--draft-model", "{missing}"], ""),
        (["--model", "{model}", "--prompt", "x", "--image", "a.png"], "need --chat"),
        (["--model", "{model}", "--prompt", "x", "--chat", "--image", "{missing}"], "cannot read images"),
        (["--model", "{model}", "--prompt", "x", "--top-p", "0"], "top-p"),
        (["--model", "{model}", "--prompt-ids", "1,99999"], "vocabulary"),
        (["--model", "{model}", "--prompt", "x", "--memory-budget", "1KB"], ""),
    ],
)
def test_failures_are_one_line(model_dir, tmp_path, args, needle):
    args = [a.format(model=model_dir, missing=tmp_path / "nope") for a in args]
    err = _one_line_failure(run("generate", *args))
    assert needle in err


def test_inspect(model_dir):
    proc = run("inspect", str(model_dir))
    assert proc.returncode == 0, proc.stderr
    assert "llama" in proc.stdout and "max context" in proc.stdout
    _one_line_failure(run("inspect", str(model_dir / "nothing-here")))


def test_bench_tiny():
    proc = run("bench", "--shape", "tiny", "--bits", "4", "-p", "16", "-g", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    assert data["engine"]["generated_tokens"] == 8 and data["engine"]["prompt_tokens"] == 16
    assert data["engine"]["generation_tps"] > 0 and data["engine"]["peak_memory_bytes"] > 0


def test_bench_vs_mlx_lm():
    pytest.importorskip("mlx_lm")
    proc = run("bench", "--shape", "tiny", "--bits", "4", "-p", "16", "-g", "8", "--vs", "mlx-lm", "--json")
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    assert data["mlx_lm"]["generated_tokens"] == 8
    assert data["ratio"]["generation"] > 0
    assert len(data["engine"]["runs"]) == len(data["mlx_lm"]["runs"]) == 1


def test_bench_repeats_report_each_figure_at_its_best_and_median():
    pytest.importorskip("mlx_lm")
    proc = run(
        "bench", "--shape", "tiny", "--bits", "4", "-p", "16", "-g", "4", "--vs", "mlx-lm", "--repeat", "3", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    for side in ("engine", "mlx_lm"):
        runs = data[side]["runs"]
        assert len(runs) == 3
        assert data[side]["prompt_tps"] == max(r["prompt_tps"] for r in runs)
        assert data[side]["generation_tps"] == max(r["generation_tps"] for r in runs)
        assert data[side]["ttft_s"] == min(r["ttft_s"] for r in runs)
        assert data[side]["median"]["generation_tps"] == sorted(r["generation_tps"] for r in runs)[1]
    medians = data["ratio_of_medians"]
    assert medians["prompt_tps"] == data["engine"]["median"]["prompt_tps"] / data["mlx_lm"]["median"]["prompt_tps"]


def test_template_command_prints_exactly_the_rendering(shared_data, tmp_path):
    """`template` output is byte-for-byte the rendering (here checked against the
    transformers golden for Qwen3), and a refusing template is one line on stderr."""
    messages = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    qwen = shared_data / "chat_templates" / "llama.cpp" / "Qwen-Qwen3-0.6B.jinja"
    proc = run("template", "--template", str(qwen), "--messages", str(path), "--add-generation-prompt")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    gemma = shared_data / "chat_templates" / "llama.cpp" / "google-gemma-2-2b-it.jinja"
    err = _one_line_failure(run("template", "--template", str(gemma), "--messages", str(path)))
    assert "System role not supported" in err


def test_chat_on_a_base_model_continues_the_text(shared_data):
    """stories260K ships no chat template: --chat falls back to the plain document,
    which for one user message is exactly the plain prompt."""
    gguf = str(shared_data / "tiny_llm" / "stories260K.gguf")
    common = ("--prompt", "Once upon a time", "--max-tokens", "12", "--temp", "0", "--json")
    chat = run("generate", "--model", gguf, "--chat", *common)
    plain = run("generate", "--model", gguf, *common)
    assert chat.returncode == 0, chat.stderr
    assert last_json(chat.stdout)["token_ids"] == last_json(plain.stdout)["token_ids"]
    assert last_json(chat.stdout)["text"].startswith(", there was")


def test_mlx_without_a_backend_is_one_line_naming_the_extra():
    """Linux's mlx wheel without mlx-cpu/mlx-cuda: the loader's message names no fix; ours does."""
    from engine.errors import backend_hint

    line = backend_hint(ImportError("libmlx.so: cannot open shared object file: No such file or directory"))
    assert line is not None and "mlx-desk[cpu]" in line and "mlx-desk[cuda]" in line
    assert backend_hint(ImportError("No module named 'tokenizers'")) is None
    assert backend_hint(ValueError("libmlx")) is None
