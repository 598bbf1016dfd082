"""The engine CLI under abuse: every case of corpus.ENGINE_CASES exits non-zero with one
line on stderr that says what is wrong, never a Python class name or a traceback."""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from engine.cli.main import main
from tests.faults.corpus import ENGINE_CASES, FILES
from tests.faults.variants import ADAPTER_VARIANTS, VARIANTS
from tests.tiny_models import make_tiny_adapter, make_tiny_llama


def _wav(path: Path, rate: int, seconds_of_samples: int = 16000) -> None:
    """A 16-bit mono PCM WAV whose header claims ``rate`` (written by hand: wave refuses 0)."""
    data = np.zeros(seconds_of_samples, np.int16).tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def _gguf_alignment_zero(path: Path) -> None:
    key = b"general.alignment"
    path.write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, 0)
    )


def _gguf_huge_array(path: Path) -> None:
    """One metadata value: an array of 2**40 uint8 (type 9 of type 0) in a 60-byte file."""
    key = b"tokenizer.ggml.scores"
    path.write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, 2**40)
    )


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("faults")
    model = make_tiny_llama(root / "model")
    out = {"model": str(model), "tmp": str(root)}
    for name, change in VARIANTS.items():
        shutil.copytree(model, root / name)
        change(root / name)
        out[name] = str(root / name)
    adapter = make_tiny_adapter(root / "adapter")
    out["adapter"] = str(adapter)
    for name, change in ADAPTER_VARIANTS.items():
        shutil.copytree(adapter, root / name)
        change(root / name)
        out[name] = str(root / name)
    for name, text in FILES.items():
        (root / name).write_text(text)
    with open(root / "huge.json", "wb") as f:
        f.truncate(40 * 2**30)  # a hole: 40 GB to a reader, nothing on disk
    _wav(root / "one_hz.wav", 1)
    _wav(root / "zero_hz.wav", 0)
    _gguf_alignment_zero(root / "align0.gguf")
    _gguf_huge_array(root / "huge_array.gguf")
    return out


CLASS_NAME = re.compile(r"\b\w+(Error|Exception|Warning)\b|Traceback")


@pytest.mark.parametrize("name,args,needle", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_bad_input_gets_one_readable_line(places, capsys, name, args, needle):
    started = time.monotonic()
    code = main([a.format(**places) for a in args])
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code != 0, f"{name}: exit code 0"
    assert err.count("\n") == 1 and err.startswith("error: "), f"{name}: not one line: {err!r}"
    assert needle in err, f"{name}: {err!r} does not say {needle!r}"
    assert not CLASS_NAME.search(err), f"{name}: a Python class name reached the user: {err!r}"
    assert took < 10, f"{name}: took {took:.1f} s"


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("max_tokens", [10**12, 10**6, 500])
def test_the_context_stops_a_reply_whatever_max_tokens_says(places, capsys, max_tokens):
    code = main(
        [
            "generate",
            "--model",
            places["ctx64"],
            "--prompt-ids",
            "5,6,7,8,9",
            "--ignore-eos",
            "--max-tokens",
            str(max_tokens),
            "--json",
        ]
    )
    out = _json(capsys)
    assert code == 0
    assert out["finish_reason"] == "length"
    assert out["prompt_tokens"] + out["generated_tokens"] == 64


def test_a_short_reply_is_not_cut(places, capsys):
    main(
        ["generate", "--model", places["ctx64"], "--prompt-ids", "5,6,7", "--ignore-eos", "--max-tokens", "7", "--json"]
    )
    out = _json(capsys)
    assert out["generated_tokens"] == 7 and out["finish_reason"] == "length"


def test_a_prompt_one_short_of_the_context_gets_one_token(places, capsys):
    main(["generate", "--model", places["ctx64"], "--prompt-ids", ",".join(["5"] * 63), "--ignore-eos", "--json"])
    out = _json(capsys)
    assert out["generated_tokens"] == 1 and out["finish_reason"] == "length"


def test_the_nan_check_does_not_fire_on_good_weights(places, capsys):
    for extra in ([], ["--temp", "0.9", "--seed", "3"], ["--logprobs"]):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    places["model"],
                    "--prompt",
                    "hello",
                    "--max-tokens",
                    "24",
                    "--ignore-eos",
                    "--json",
                    *extra,
                ]
            )
            == 0
        )
        assert _json(capsys)["generated_tokens"] == 24


def test_the_adapter_checks_do_not_fire_on_a_good_peft_adapter(places, capsys):
    code = main(["generate", "--model", places["model"], "--prompt", "hi", "--max-tokens", "3", "--adapter",
                 places["peft_good"], "--json"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert _json(capsys)["generated_tokens"] >= 1
