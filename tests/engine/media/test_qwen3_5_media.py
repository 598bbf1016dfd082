"""Qwen3.5 and Qwen3.5-MoE images and video against transformers 5.23
(tests/golden/make_qwen3_5_media_goldens.py).

The tiny checkpoints (hybrid: gated DeltaNet and gated attention layers, partial
interleaved mRoPE, a tower without DeepStack) are bf16 on disk and loaded in float32, as
the references ran. The photo is ../shared/data/images/chelsea.png; the clip is made from
the shared photos (clips.py). Compared: pixel values (bit for bit), grids, tower features,
expanded prompts (video timestamps included), 3-D positions, greedy ids with
log-probabilities; then the same replies through n-gram speculation, a continued chat
that reuses the cached prefix (recurrent snapshots included), the published repos' and
mlx-vlm's spellings, and the CLI.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.api import GenerationParams, VideoLimits
from engine.media.parts import split_media
from engine.runtime.host import ModelHost

pytest.importorskip("av")

from tests.engine.media.clips import make_clip
from tests.engine.media.test_qwen3_vl import float32_copy, load_float32, media_for, sha

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "qwen3_5_media"
FAMILIES = ["qwen3_5", "qwen3_5_moe"]
ROOT = Path(__file__).resolve().parents[3]


def expected(name: str) -> dict:
    return json.loads((GOLDEN / name / "expected.json").read_text())


@pytest.fixture(scope="module")
def clip(tmp_path_factory, shared_data) -> Path:
    return make_clip(tmp_path_factory.mktemp("clip") / "clip.mov", shared_data / "images")


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    return request.param, load_float32(GOLDEN / request.param)


def test_the_tower_is_qwen3_vl_s_without_deepstack_and_takes_video():
    from engine.media.towers import families_for

    host = ModelHost()
    host.load(str(GOLDEN / "qwen3_5"))
    assert host.towers.kinds == {"image", "video"}
    assert host.towers.encoder("image").vision_config.deepstack_visual_indexes == ()
    assert {"qwen3_5", "qwen3_5_moe"} <= set(families_for("video"))
    # The app's note at the drop: its processor config's 8 frames (not Qwen3-VL's default 768),
    # known at load without the tower's weights.
    assert host.info.video_limits == VideoLimits(fps=2.0, max_frames=8) and not host.towers.loaded


@pytest.mark.parametrize("case", ["image", "video", "both"])
def test_pixels_features_prompt_and_positions_match_transformers(loaded, shared_data, clip, case):
    name, host = loaded
    exp = expected(name)[case]
    chat = host.session("prompt")
    messages, items = split_media(exp["messages"], media_for(case, shared_data, clip))
    host.towers.prepared.clear()  # prepared afresh, pixels and all (a follow-up keeps none)
    prompt = chat.media_prompt(chat.render(messages), items)
    assert prompt.ids == exp["prompt_ids"]
    positions = host.model.rope_index(prompt.ids, [(s.start, s.end, s.item.grid) for s in prompt.spans])
    assert positions.tolist() == exp["position_ids"]
    assert int(positions.max()) + 1 - len(prompt.ids) == exp["rope_delta"]
    for kind in ("image", "video"):
        spans = [s for s in prompt.spans if s.item.kind == kind]
        if not spans:
            continue
        pixels = np.concatenate([np.asarray(s.item.data[0]) for s in spans])
        assert list(pixels.shape) == exp[f"{kind}_pixels"]["shape"]
        assert sha(pixels) == exp[f"{kind}_pixels"]["sha256"]
    if case != "both":  # the image's, or the clip's first frame group's, features
        features = np.array(host.towers.features(prompt.spans[0].item))
        np.testing.assert_allclose(features, np.array(exp[f"{case}_features"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [512, 7])
@pytest.mark.parametrize("case", ["image", "video", "both"])
def test_greedy_ids_and_logprobs_match_transformers(loaded, shared_data, clip, case, chunk):
    """A chunk of 7 ends inside image and frame runs, and the recurrent layers carry
    their state across chunks."""
    name, host = loaded
    exp = expected(name)[case]
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True, prefill_chunk=chunk)
    result = host.generate(f"{case}{chunk}", exp["messages"], params, media=media_for(case, shared_data, clip))
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])


@pytest.mark.parametrize("case", ["image", "video"])
def test_speculative_decoding_after_media_matches_transformers(loaded, shared_data, clip, case):
    """N-gram drafts are verified at the shifted mRoPE positions and rejected ones rewind
    the recurrent layers; greedy output stays transformers'. (The compiled hybrid step
    stands aside at shifted positions: they decode plainly.) Four drafts a round, pinned:
    the adaptive depth may otherwise stop drafting on a tiny model's timings."""
    name, host = loaded
    exp = expected(name)[case]
    n = len(exp["token_ids"])
    spec = GenerationParams(
        max_tokens=n, logprobs=True, ignore_eos=True, speculative="ngram", ngram_size=1, num_draft_tokens=4
    )
    result = host.generate(f"spec-{case}", exp["messages"], spec, media=media_for(case, shared_data, clip))
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
    assert result.stats.draft_tokens > 0


def test_a_continued_chat_with_an_image_reuses_its_prefix_and_matches_a_fresh_run(shared_data, clip):
    """Turn 2 of a chat whose first message holds an image: the session keeps the image's
    encoded features and the recurrent state at the end of turn 1, prefills only the new
    text, and answers exactly as a fresh session that prefills everything."""
    exp = expected("qwen3_5")["image"]
    image = media_for("image", shared_data, clip)
    params = GenerationParams(max_tokens=6, logprobs=True, ignore_eos=True)
    host = load_float32(GOLDEN / "qwen3_5")
    first = host.generate("chat", exp["messages"], params, media=image)
    turn2 = [
        *exp["messages"],
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And the colour of it?"},
    ]
    calls = host.towers.encode_calls
    again = host.generate("chat", turn2, params, media=image)
    assert again.stats.cached_tokens > len(exp["prompt_ids"]) - 1
    assert host.towers.encode_calls == calls  # the image was not encoded again

    fresh = load_float32(GOLDEN / "qwen3_5")
    whole = fresh.generate("fresh", turn2, params, media=image)
    assert whole.stats.cached_tokens == 0
    assert again.token_ids == whole.token_ids
    np.testing.assert_allclose(again.token_logprobs, whole.token_logprobs, atol=1e-4, rtol=0)

    # Regenerating the reply goes back to the prompt's end: the recurrent layers' snapshot.
    regenerated = host.generate("chat", turn2, params, media=image)
    assert regenerated.stats.cached_tokens >= again.stats.prompt_tokens - 1
    assert regenerated.token_ids == whole.token_ids
    np.testing.assert_allclose(regenerated.token_logprobs, whole.token_logprobs, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def published_folder(tmp_path_factory) -> Path:
    """The dense golden in the other spellings it meets in the wild: the published repos'
    config (``rope_theta`` beside an ``rope_scaling`` block holding mRoPE, the layer kinds
    as ``full_attention_interval``) and processor files (preprocessor_config.json +
    video_preprocessor_config.json), and mlx-vlm's weights (``language_model.*``,
    ``vision_tower.*``, norms stored as 1 + w, conv kernels [C, K, 1], a channels-last
    patch kernel)."""
    import mlx.core as mx

    folder = tmp_path_factory.mktemp("published") / "qwen3_5"
    shutil.copytree(GOLDEN / "qwen3_5", folder)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    text["rope_scaling"] = rope
    kinds = text.pop("layer_types")
    text["full_attention_interval"] = kinds.index("full_attention") + 1
    (folder / "config.json").write_text(json.dumps(config))
    processor = json.loads((folder / "processor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(processor["image_processor"]))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(processor["video_processor"]))
    (folder / "processor_config.json").unlink()
    one_centred = (".input_layernorm.weight", ".post_attention_layernorm.weight", "norm.weight", "_norm.weight")
    renamed = {}
    for name, value in mx.load(str(folder / "model.safetensors")).items():
        if name == "model.visual.patch_embed.proj.weight":
            value = value.transpose(0, 2, 3, 4, 1)
        elif name.endswith("conv1d.weight"):
            value = value.swapaxes(1, 2)
        elif name.startswith("model.language_model.") and name.endswith(one_centred) and value.ndim == 1:
            if not name.endswith("linear_attn.norm.weight"):  # the gated norm is plain w
                value = (value.astype(mx.float32) + 1.0).astype(value.dtype)
        for old, new in (
            ("model.language_model.", "language_model.model."),
            ("lm_head.", "language_model.lm_head."),
            ("model.visual.", "vision_tower."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = value
    mx.save_safetensors(str(folder / "model.safetensors"), renamed, metadata={"format": "mlx"})
    return folder


def test_published_config_and_mlx_vlm_weights_give_the_same_replies(published_folder, shared_data, clip):
    host = load_float32(published_folder)
    assert host.info.video_limits == VideoLimits(fps=2.0, max_frames=8)  # from video_preprocessor_config.json
    for case in ("image", "video"):
        exp = expected("qwen3_5")[case]
        params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True)
        result = host.generate(f"published-{case}", exp["messages"], params, media=media_for(case, shared_data, clip))
        assert result.stats.prompt_tokens == len(exp["prompt_ids"])
        assert result.token_ids == exp["token_ids"]
        # mlx-vlm stores 1 + w in bf16, which rounds coarser than w does (about 2e-3 here).
        np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=5e-3, rtol=0)


@pytest.fixture(scope="module")
def float32_folder(tmp_path_factory) -> Path:
    """The MoE golden with float32 weights, for the CLI (which computes in the
    checkpoint's dtype)."""
    return float32_copy(GOLDEN / "qwen3_5_moe", tmp_path_factory.mktemp("f32") / "qwen3_5_moe")


def test_cli_generate_with_an_image_and_a_video_matches_transformers(float32_folder, shared_data, clip):
    exp = expected("qwen3_5_moe")["both"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            str(float32_folder),
            "--chat",
            "--prompt",
            "Describe both.",
            "--video",
            str(clip),
            "--image",
            str(shared_data / "images" / "chelsea.png"),
            "--max-tokens",
            str(len(exp["token_ids"])),
            "--ignore-eos",
            "--logprobs",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompt_tokens"] == len(exp["prompt_ids"])
    assert out["token_ids"] == exp["token_ids"]
    np.testing.assert_allclose(out["token_logprobs"], exp["token_logprobs"], atol=1e-3, rtol=0)


def _bench(*extra: str) -> subprocess.CompletedProcess:
    args = ["--shape", "qwen3.5-tiny", "--media", "video", "--media-seconds", "2", "--media-size", "128x96"]
    return subprocess.run(
        [sys.executable, "-m", "engine", "bench", *args, "--bits", "16", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_media_bench_runs_on_the_tiny_qwen3_5_shape():
    proc = _bench("--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])["engine"]
    assert out["runs"] == 2  # 4 frames (min_frames), two per temporal patch
    assert out["ttft_s"] == pytest.approx(out["preprocess_s"] + out["tower_s"] + out["prefill_s"], rel=1e-6)


def test_bench_vs_mlx_vlm_without_mlx_vlm_says_what_to_install_in_one_line():
    import importlib.util

    if importlib.util.find_spec("mlx_vlm") is not None:
        pytest.skip("mlx-vlm is installed here")
    proc = _bench("--vs", "mlx-vlm")
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "pip install mlx-vlm" in err
