"""Gemma 3 pan-and-scan against transformers' Gemma3Processor (tests/golden/make_media_goldens.py).

The golden holds, for a wide and a tall picture built from ../shared/data/images and for
chelsea.png (whose crops would be under the minimum size), every view's pixel values at the
tiny model's 32 px, the expanded prompt text and ids, and the tiny Gemma 3 model's greedy
ids and log-probabilities with the crops in the prompt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.api import GenerationParams, MediaInput
from engine.media.image_processors import pan_and_scan_boxes
from engine.media.prompt import expand_placeholders
from engine.runtime.host import ModelHost
from engine.runtime.session import common_prefix_length

ROOT = Path(__file__).resolve().parents[3]
GEMMA = ROOT / "tests" / "golden" / "vision" / "gemma3"
GOLDEN = ROOT / "tests" / "golden" / "media"
META = json.loads((GOLDEN / "gemma3_pan_and_scan.json").read_text())
ATOL = 1e-5  # as the plain Gemma 3 preprocessing test
CROPPED = ["wide", "tall"]


def pictures(images: Path) -> dict[str, Image.Image]:
    """The same pictures the golden script builds (their pixel hashes are checked)."""

    def rgb(name: str) -> Image.Image:
        with Image.open(images / name) as im:
            return im.convert("RGB")

    wide = Image.new("RGB", (1003, 300), (40, 90, 160))
    wide.paste(rgb("chelsea.png"), (0, 0))
    wide.paste(rgb("coffee.png").crop((0, 50, 552, 350)), (451, 0))
    tall = Image.new("RGB", (300, 1100), (200, 180, 40))
    tall.paste(rgb("astronaut.png").crop((100, 0, 400, 512)), (0, 0))
    tall.paste(rgb("rocket.jpg").crop((170, 0, 470, 427)), (0, 512))
    return {"wide": wide, "tall": tall, "below": rgb("chelsea.png")}


@pytest.fixture(scope="module")
def files(shared_data, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("pictures")
    out = {}
    for case, picture in pictures(shared_data / "images").items():
        assert hashlib.sha256(picture.tobytes()).hexdigest() == META["cases"][case]["picture_sha256"], case
        out[case] = str(folder / f"{case}.png")
        picture.save(out[case])
    return out


@pytest.fixture(scope="module")
def host() -> ModelHost:
    h = ModelHost()
    info = h.load(str(GEMMA))
    assert info.pan_and_scan is False  # the tiny model's config turns it off
    return h


def _gold_pixels(case: str) -> np.ndarray:
    with np.load(GOLDEN / "gemma3_pan_and_scan.npz") as z:
        return z[f"{case}/pixel_values"]


def _messages(image: dict | None = None) -> list[dict]:
    return [
        {**m, "content": [image or c if c["type"] == "image" else c for c in m["content"]]} for m in META["messages"]
    ]


def test_crop_counts_match_transformers(shared_data):
    defaults = META["defaults"]
    for name, crops in META["num_crops"].items():
        with Image.open(shared_data / "images" / name) as im:
            boxes = pan_and_scan_boxes(
                im.width,
                im.height,
                defaults["pan_and_scan_min_crop_size"],
                defaults["pan_and_scan_max_num_crops"],
                defaults["pan_and_scan_min_ratio_to_activate"],
            )
        assert len(boxes) == crops, name
    # The wide picture's last crop keeps only what is inside the picture.
    assert pan_and_scan_boxes(1003, 300) == [(0, 0, 335, 300), (335, 0, 670, 300), (670, 0, 1003, 300)]
    assert pan_and_scan_boxes(300, 1100)[-1] == (0, 825, 300, 1100)
    assert pan_and_scan_boxes(1000, 900) == []  # under the 1.2 ratio
    assert len(pan_and_scan_boxes(5000, 300)) == 4  # at most max_num_crops


@pytest.mark.parametrize("case", sorted(META["cases"]))
def test_views_pixel_values_match_transformers(host, files, case):
    item = host.towers.prepare([MediaInput("image", files[case], pan_and_scan=True)])[0]
    runs = item.runs()
    assert len(runs) == 1 + META["cases"][case]["num_crops"]
    got = np.concatenate([run.data for run in runs])
    gold = _gold_pixels(case)
    assert got.dtype == np.float32 and got.shape == gold.shape
    np.testing.assert_allclose(got, gold, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", sorted(META["cases"]))
def test_prompt_text_and_ids_match_transformers(host, files, case):
    exp = META["cases"][case]
    chat = host.session("prompt")
    items = [MediaInput("image", files[case], pan_and_scan=True)]
    rendered = chat.render(_messages())
    assert rendered == META["template_text"]
    prepared = host.towers.prepare(items)
    assert expand_placeholders(rendered, prepared, host.towers.placeholders()) == exp["prompt_text"]
    prompt = chat.media_prompt(rendered, items)
    assert prompt.ids == exp["prompt_ids"]
    soft = [j for j, t in enumerate(exp["prompt_ids"]) if t == host.towers.token_ids()["image"]]
    assert [j for s in prompt.spans for j in range(s.start, s.end)] == soft
    assert len(prompt.spans) == 1 + exp["num_crops"]


@pytest.mark.parametrize("chunk", [512, 7])
@pytest.mark.parametrize("case", CROPPED)
def test_greedy_ids_and_logprobs_match_transformers(host, files, case, chunk):
    """Turned on by the request; a 7-token prefill chunk ends inside image runs."""
    exp = META["cases"][case]
    params = GenerationParams(
        max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True, prefill_chunk=chunk, pan_and_scan=True
    )
    result = host.generate(f"{case}{chunk}", _messages({"type": "image", "image": files[case]}), params)
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=2e-3, rtol=0)


def _folder_with(tmp_path: Path, name: str, data: dict) -> Path:
    folder = tmp_path / "gemma3"
    shutil.copytree(GEMMA, folder)
    (folder / name).write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("where", ["preprocessor_config.json", "processor_config.json"])
def test_the_model_config_turns_it_on_and_a_request_turns_it_off(tmp_path, files, where):
    pre = json.loads((GEMMA / "preprocessor_config.json").read_text())
    pre.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=None)  # null: the default, 256
    data = pre if where == "preprocessor_config.json" else {"image_processor": pre, "image_seq_length": 4}
    h = ModelHost()
    assert h.load(str(_folder_with(tmp_path, where, data))).pan_and_scan is True
    chat = h.session("x")
    rendered = chat.render(_messages())
    wide = files["wide"]
    assert chat.media_prompt(rendered, [MediaInput("image", wide)]).ids == META["cases"]["wide"]["prompt_ids"]
    off = chat.media_prompt(rendered, [MediaInput("image", wide, pan_and_scan=False)])
    assert len(off.spans) == 1 and len(off.ids) == len(META["cases"]["below"]["prompt_ids"])
    # The request's word, then an image part's own word.
    params = GenerationParams(max_tokens=1, ignore_eos=True, pan_and_scan=False)
    assert h.generate("x", _messages({"type": "image", "image": wide}), params).stats.prompt_tokens == len(off.ids)
    part = {"type": "image", "image": wide, "pan_and_scan": True}
    assert h.generate("x", _messages(part), params).stats.prompt_tokens == len(META["cases"]["wide"]["prompt_ids"])


def test_each_view_has_its_own_key_and_encoding(host, files):
    """Crops of one picture never share an encoding, in the cache or in prefix reuse; the
    whole image keys as it does without crops (same pixels), so toggling reuses it."""
    host.towers.cache.clear()  # encoded and prepared before: prepare afresh, pixels and all
    host.towers.prepared.clear()
    item = host.towers.prepare([MediaInput("image", files["tall"], pan_and_scan=True)])[0]
    plain = host.towers.prepare([MediaInput("image", files["tall"], pan_and_scan=False)])[0]
    keys = [run.key for run in item.runs()]
    assert len(set(keys)) == len(keys) == 5 and keys[0] == plain.key
    calls = host.towers.encode_calls
    features = [np.array(host.towers.features(run)) for run in item.runs()]
    assert host.towers.encode_calls == calls + 5
    tower = host.towers.encoder("image")
    for run, got in zip(item.runs(), features):
        np.testing.assert_allclose(got, np.array(tower.run(tower.load(), run)), atol=1e-6, rtol=0)
    assert all(np.abs(a - b).max() > 1e-3 for i, a in enumerate(features) for b in features[i + 1 :])
    # A second request encodes nothing again.
    params = GenerationParams(max_tokens=2, ignore_eos=True, pan_and_scan=True)
    host.generate("keys", _messages({"type": "image", "image": files["tall"]}), params)
    host.generate("keys", _messages({"type": "image", "image": files["tall"]}), params)
    assert host.towers.encode_calls == calls + 5


def test_prefix_reuse_stops_at_the_first_view_that_differs(host, files, tmp_path):
    """Two wide pictures that differ only inside the last crop: their prompt keys part at
    the first soft token (the file differs), never matching a crop of one to the other's."""
    changed = Image.open(files["wide"]).convert("RGB")
    changed.paste((255, 0, 0), (900, 100, 1000, 200))
    other = str(tmp_path / "changed.png")
    changed.save(other)
    chat = host.session("reuse")
    rendered = chat.render(_messages())
    a = chat.media_prompt(rendered, [MediaInput("image", files["wide"], pan_and_scan=True)])
    b = chat.media_prompt(rendered, [MediaInput("image", other, pan_and_scan=True)])
    assert a.ids == b.ids
    assert common_prefix_length(a.keys, b.keys) == a.spans[0].start
    span_keys = [{a.keys[j][0] for j in range(s.start, s.end)} for s in a.spans]
    assert all(len(k) == 1 for k in span_keys) and len(set.union(*span_keys)) == len(a.spans)


def test_the_cli_flag_turns_it_on(files):
    """`generate --pan-and-scan`: the wide picture's crops join the prompt."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]

    def prompt_tokens(*flags: str) -> int:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "engine",
                "generate",
                "--model",
                str(GEMMA),
                "--chat",
                "--prompt",
                "What is it?",
                "--image",
                files["wide"],
                "--max-tokens",
                "1",
                "--temp",
                "0",
                "--json",
                *flags,
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])["prompt_tokens"]

    plain, split = prompt_tokens(), prompt_tokens("--pan-and-scan")
    assert split > plain and prompt_tokens("--no-pan-and-scan") == plain
