"""Qwen3-VL and Qwen3-VL-MoE images and video against transformers 5.23
(tests/golden/make_qwen3_vl_goldens.py).

The tiny checkpoints are bf16 on disk and loaded in float32, as the references ran. The
photo is ../shared/data/images/chelsea.png; the clip is made here from the shared photos
(clips.py: lossless PNG frames, so the decoded pixels are the referee's). Compared: the
processors' pixel values (bit for bit) and grids, the sampled frames, tower features
(merged + DeepStack), the expanded prompts (video timestamps included), 3-D positions,
and greedy ids with log-probabilities.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine.api import GenerationParams, MediaInput
from engine.errors import MediaError
from engine.media.image import Qwen2VLImageProcessor, load_image
from engine.media.parts import split_media
from engine.runtime.host import ModelHost

pytest.importorskip("av")

from tests.engine.media.clips import make_clip, make_long_clip, make_three_hour_clip

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "qwen3_vl"
FAMILIES = ["qwen3_vl", "qwen3_vl_moe"]


def expected(name: str) -> dict:
    return json.loads((GOLDEN / name / "expected.json").read_text())


def sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a, dtype=np.float32)).tobytes()).hexdigest()


def load_float32(path: Path) -> ModelHost:
    from engine.runtime import loading as loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_model", functools.partial(loader.load_model, dtype="float32"))
        host = ModelHost()
        host.load(str(path))
    return host


@pytest.fixture(scope="module")
def clip(tmp_path_factory, shared_data) -> Path:
    return make_clip(tmp_path_factory.mktemp("clip") / "clip.mov", shared_data / "images")


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    return request.param, load_float32(GOLDEN / request.param)


def media_for(case: str, shared_data: Path, clip: Path) -> list[MediaInput]:
    image = MediaInput("image", str(shared_data / "images" / "chelsea.png"))
    video = MediaInput("video", str(clip))
    return {"image": [image], "video": [video], "both": [image, video]}[case]


def test_image_processor_matches_transformers_on_the_shared_photos(shared_data):
    exp = json.loads((GOLDEN / "processors.json").read_text())
    processor = Qwen2VLImageProcessor.from_config(exp["settings"])
    for name, want in exp["photos"].items():
        vision = processor([load_image(shared_data / "images" / name)])
        assert vision.image_grid_thw[0].tolist() == want["grid"], name
        assert list(vision.pixel_values.shape) == want["pixels"]["shape"], name
        assert sha(vision.pixel_values) == want["pixels"]["sha256"], name


def test_video_sampling_and_patches_match_transformers(clip):
    from engine.media.qwen3_vl.encoders import read_video_preprocessor
    from engine.media.qwen3_vl.processor import VideoProcessor
    from engine.media.video import probe, read_frames

    want = json.loads((GOLDEN / "processors.json").read_text())["clip"]
    host = ModelHost()
    host.load(str(GOLDEN / "qwen3_vl"))
    processor = VideoProcessor.from_config(read_video_preprocessor(host.towers.source))
    info = probe(clip)
    assert (info.frames, info.fps) == (want["total_frames"], want["fps"])
    indices = processor.sample(info.frames, info.fps)
    assert indices.tolist() == want["indices"]
    patches = processor(read_frames(clip, indices), indices, info.fps)
    assert list(patches.grid) == want["grid"]
    assert list(patches.pixel_values.shape) == want["pixels"]["shape"]
    assert sha(patches.pixel_values) == want["pixels"]["sha256"]


@pytest.mark.parametrize("case", ["image", "video", "both"])
def test_features_prompt_and_positions_match_transformers(loaded, shared_data, clip, case):
    name, host = loaded
    exp = expected(name)[case]
    media = media_for(case, shared_data, clip)
    chat = host.session("prompt")
    messages, items = split_media(exp["messages"], media)
    prompt = chat.media_prompt(chat.render(messages), items)
    assert prompt.ids == exp["prompt_ids"]
    positions = host.model.rope_index(prompt.ids, [(s.start, s.end, s.item.grid) for s in prompt.spans])
    assert positions.tolist() == exp["position_ids"]
    assert int(positions.max()) + 1 - len(prompt.ids) == exp["rope_delta"]
    if case != "both":  # the image's, or the clip's first frame group's, features
        features = np.array(host.towers.features(prompt.spans[0].item))
        np.testing.assert_allclose(features, np.array(exp[f"{case}_features"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [512, 7])
@pytest.mark.parametrize("case", ["image", "video", "both"])
def test_greedy_ids_and_logprobs_match_transformers(loaded, shared_data, clip, case, chunk):
    """A chunk of 7 ends inside image and frame runs; the prefill moves it off them."""
    name, host = loaded
    exp = expected(name)[case]
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True, prefill_chunk=chunk)
    result = host.generate(f"{case}{chunk}", exp["messages"], params, media=media_for(case, shared_data, clip))
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])


def test_video_frames_are_encoded_once_and_cached_by_content(shared_data, clip, tmp_path):
    host = load_float32(GOLDEN / "qwen3_vl")
    exp = expected("qwen3_vl")["video"]
    params = GenerationParams(max_tokens=2, ignore_eos=True)
    host.generate("a", exp["messages"], params, media=[MediaInput("video", str(clip))])
    groups = expected("qwen3_vl")["video"]["video_grid"][0]
    assert host.towers.encode_calls == groups
    copy = tmp_path / "same.mov"
    copy.write_bytes(clip.read_bytes())  # same content, another name: no new encodes
    host.generate("b", exp["messages"], params, media=[MediaInput("video", str(copy))])
    assert host.towers.encode_calls == groups


def test_a_model_without_video_refuses_naming_the_families_that_can(clip):
    host = ModelHost()
    host.load(str(GOLDEN.parent / "vision" / "qwen2_5_vl"))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(MediaError, match="cannot watch video.*qwen3_vl") as info:
        host.generate("v", messages, GenerationParams(max_tokens=1), media=[MediaInput("video", str(clip))])
    assert "\n" not in str(info.value)
    assert not host.tower_loaded


def test_bad_videos_get_one_line_each(shared_data, clip, tmp_path):
    from engine.media.video import probe

    truncated = tmp_path / "truncated.mov"
    truncated.write_bytes(clip.read_bytes()[:300])
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video at all" * 50)
    cases = {
        garbage: "not a video",
        truncated: "not a video|corrupt|no frames",
        shared_data / "audio" / "jfk.wav": "no video stream",
        tmp_path / "missing.mp4": "not found",
    }
    for path, message in cases.items():
        with pytest.raises(MediaError, match=message) as info:
            probe(path)
        assert "\n" not in str(info.value), path


def test_a_long_video_is_sampled_to_the_frame_limit_by_seeking_with_a_note(clip, tmp_path):
    """25 minutes at 2 fps (3,000 frames, a keyframe every 30): past the golden processor's
    8-frame limit, so 8 frames are read by seeking (each over SEEK_GAP_FRAMES past the one
    before), the very frames an in-order decode gives, and the reply carries a note saying
    so. A clip within the limit has none."""
    from engine.media.qwen3_vl.encoders import read_video_preprocessor
    from engine.media.qwen3_vl.processor import VideoProcessor
    from engine.media.video import SEEK_GAP_FRAMES, probe, read_frames

    long = make_long_clip(tmp_path / "talk.mp4")
    host = load_float32(GOLDEN / "qwen3_vl")
    processor = VideoProcessor.from_config(read_video_preprocessor(host.towers.source))
    info = probe(long)
    assert (info.frames, info.fps, info.seconds) == (3000, 2.0, 1500.0)
    indices = processor.sample(info.frames, info.fps)
    assert len(indices) == processor.max_frames == 8 and indices[-1] == 2999
    assert min(np.diff(indices)) > SEEK_GAP_FRAMES
    seeked = read_frames(long, indices, seek=True)
    np.testing.assert_array_equal(seeked, read_frames(long, indices))
    assert len({int(f.mean()) for f in seeked}) == 8  # eight different frames, not one repeated
    mixed = [0, 5, 6, 40, 900, 901, 1700, 2999]  # near ones decoded on, far ones sought
    np.testing.assert_array_equal(read_frames(long, mixed, seek=True), read_frames(long, mixed))
    exp = expected("qwen3_vl")["video"]
    params = GenerationParams(max_tokens=2, ignore_eos=True)
    result = host.generate("long", exp["messages"], params, media=[MediaInput("video", str(long))])
    assert result.notes == [
        "A video of 25 min 00 s is longer than the model takes at 2 frames a second: "
        "it was sampled to 8 frames over its whole duration (one every 187.5 s)."
    ]
    assert host.towers.encode_calls == 4  # two frames a group
    short = host.generate("short", exp["messages"], params, media=[MediaInput("video", str(clip))])
    assert short.notes == []


def test_a_three_hour_video_is_read_from_its_header_not_refused(tmp_path):
    from engine.media.video import probe, read_frames

    path = make_three_hour_clip(tmp_path / "long.mov")
    info = probe(path)
    assert info.seconds == 3 * 3600 and info.frames == 3
    frames = read_frames(path, [0, 1, 2], seek=True)
    assert [int(f[0, 0, 0]) for f in frames] == [0, 60, 120]


@pytest.fixture(scope="module")
def float32_folder(tmp_path_factory) -> Path:
    """The qwen3_vl golden with its weights stored in float32, for the CLI (which computes
    in the checkpoint's dtype)."""
    return float32_copy(GOLDEN / "qwen3_vl", tmp_path_factory.mktemp("f32") / "qwen3_vl")


def float32_copy(golden: Path, folder: Path) -> Path:
    """A copy of a golden model folder with its weights stored in float32."""
    import shutil

    import mlx.core as mx

    shutil.copytree(golden, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(
        str(folder / "model.safetensors"),
        {k: v.astype(mx.float32) for k, v in weights.items()},
        metadata={"format": "pt"},
    )
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _cli(*args: str):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    return subprocess.run(
        [sys.executable, "-m", "engine", "generate", *args], cwd=root, capture_output=True, text=True, timeout=300
    )


def test_cli_video_then_image_puts_images_first_and_matches_transformers(float32_folder, shared_data, clip):
    """--video given before --image: the message still holds the image, then the video."""
    exp = expected("qwen3_vl")["both"]
    proc = _cli(
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
        "10",
        "--ignore-eos",
        "--logprobs",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompt_tokens"] == len(exp["prompt_ids"])
    assert out["token_ids"] == exp["token_ids"]
    np.testing.assert_allclose(out["token_logprobs"], exp["token_logprobs"], atol=1e-3, rtol=0)


def test_cli_video_on_a_model_without_video_is_one_line(clip):
    proc = _cli(
        "--model",
        str(GOLDEN.parent / "vision" / "qwen2_5_vl"),
        "--chat",
        "--prompt",
        "hi",
        "--video",
        str(clip),
        "--max-tokens",
        "2",
    )
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "cannot watch video" in err and "qwen3_vl" in err


@pytest.mark.parametrize("case", ["image", "video"])
def test_compiled_and_speculative_decoding_after_media_match_transformers(loaded, shared_data, clip, case, monkeypatch):
    """Interleaved mRoPE continues text at shifted positions: the compiled decode step and
    n-gram verification passes follow that shift, and greedy output stays transformers'."""
    import engine.decode.loop as generate
    from engine.decode.compiled_step import CompiledDecoder

    name, host = loaded
    exp = expected(name)[case]
    plain_step = generate.generate_step
    monkeypatch.setattr(generate, "generate_step", lambda *a, **k: plain_step(*a, **{**k, "compiled": True}))
    steps = []
    real_call = CompiledDecoder.__call__

    def counted(self, tokens, cache, *shift):
        out = real_call(self, tokens, cache, *shift)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(CompiledDecoder, "__call__", counted)
    n = len(exp["token_ids"])
    params = GenerationParams(max_tokens=n, logprobs=True, ignore_eos=True)
    result = host.generate(f"compiled-{case}", exp["messages"], params, media=media_for(case, shared_data, clip))
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
    assert sum(steps) == n - 1  # every step after the prompt's last token ran compiled

    import engine.decode.speculative as speculative

    plain_spec = speculative.speculative_step
    spec = GenerationParams(max_tokens=n, logprobs=True, ignore_eos=True, speculative="ngram", ngram_size=1)
    for compiled in (False, True):
        steps.clear()
        monkeypatch.setattr(
            speculative, "speculative_step", lambda *a, c=compiled, **k: plain_spec(*a, **{**k, "compiled": c})
        )
        result = host.generate(
            f"spec-{case}-{compiled}", exp["messages"], spec, media=media_for(case, shared_data, clip)
        )
        assert result.token_ids == exp["token_ids"]
        np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)
        assert result.stats.draft_tokens > 0
        assert any(steps) == compiled  # verification passes ran compiled when asked


@pytest.fixture(scope="module")
def published_folder(tmp_path_factory) -> Path:
    """The qwen3_vl golden in the other spellings it meets in the wild: the published
    repos' config (mRoPE in ``rope_scaling`` beside ``rope_theta``) and processor files
    (preprocessor_config.json + video_preprocessor_config.json), and mlx-vlm's weight
    names and layout (``language_model.*``, ``vision_tower.*``, a channels-last patch kernel)."""
    import shutil

    import mlx.core as mx

    folder = tmp_path_factory.mktemp("published") / "qwen3_vl"
    shutil.copytree(GOLDEN / "qwen3_vl", folder)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    processor = json.loads((folder / "processor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(processor["image_processor"]))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(processor["video_processor"]))
    (folder / "processor_config.json").unlink()
    renamed = {}
    for name, value in mx.load(str(folder / "model.safetensors")).items():
        if name == "model.visual.patch_embed.proj.weight":
            value = value.transpose(0, 2, 3, 4, 1)
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


def test_published_config_and_mlx_vlm_weight_names_give_the_same_video_reply(published_folder, clip):
    exp = expected("qwen3_vl")["video"]
    host = load_float32(published_folder)
    params = GenerationParams(max_tokens=len(exp["token_ids"]), logprobs=True, ignore_eos=True)
    result = host.generate("published", exp["messages"], params, media=[MediaInput("video", str(clip))])
    assert result.stats.prompt_tokens == len(exp["prompt_ids"])
    assert result.token_ids == exp["token_ids"]
    np.testing.assert_allclose(result.token_logprobs, exp["token_logprobs"], atol=1e-3, rtol=0)


def test_media_bench_runs_on_a_tiny_shape():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "bench",
            "--shape",
            "qwen3-vl-tiny",
            "--media",
            "video",
            "--media-seconds",
            "2",
            "--media-size",
            "128x96",
            "--bits",
            "16",
            "--json",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])["engine"]
    assert out["runs"] == 2  # 4 frames (min_frames), two per temporal patch
    assert set(out["follow_up"]) == {"prepare_s", "follow_up_s"}  # the follow-up found the clip by content
    parts = out["preprocess_s"] + out["tower_s"] + out["prefill_s"]
    assert out["ttft_s"] == pytest.approx(parts, rel=1e-6)
