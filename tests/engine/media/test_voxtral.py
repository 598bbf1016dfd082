"""Voxtral against transformers' VoxtralForConditionalGeneration.

tests/golden/make_voxtral_goldens.py saved a tiny random Voxtral as a Hugging Face folder
(tests/golden/voxtral_tiny: 128 mels and 1500 encoder positions as the real one, four
encoder frames per audio token, a 2-layer Llama) and recorded, for ../shared/data/audio/
jfk.wav, the processor path's features (11 s: one 30 s chunk; three times over: two), the
projected audio, the prompt with 375 [AUDIO] tokens per chunk, and greedy ids with their
log-probabilities.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.api import GenerationParams, MediaInput
from engine.errors import MediaError
from engine.media.audio import load_audio
from engine.media.voxtral.tower import VoxtralEncoderConfig, clip_features
from engine.runtime.host import ModelHost
from engine.runtime.model_info import inspect_model

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
FOLDER = GOLDEN / "voxtral_tiny"
META = json.loads((GOLDEN / "media" / "voxtral_tiny.json").read_text())
AUDIO_ID = META["config"]["audio_token_id"]
QUESTION = META["messages"][0]["content"][1]["text"]
PARAMS = GenerationParams(max_tokens=META["steps"], ignore_eos=True, logprobs=True)
CFG = VoxtralEncoderConfig.from_dict(META["config"]["audio_config"])


def ask(clip, text: str = QUESTION) -> list[dict]:
    parts = ([{"type": "audio", "audio": clip}] if clip is not None else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def gold() -> dict:
    with np.load(GOLDEN / "media" / "voxtral_tiny.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def clips(shared_data) -> dict[str, np.ndarray]:
    jfk = load_audio(shared_data / "audio" / "jfk.wav")
    return {"short": jfk, "long": np.concatenate([jfk, jfk, jfk])}


@pytest.fixture(scope="module")
def host() -> ModelHost:
    h = ModelHost()
    h.load(str(FOLDER))
    return h


def test_features_match_the_processor_one_and_two_chunks(clips, gold):
    for key, chunks in (("short", 1), ("long", 2)):
        feats = clip_features(clips[key], CFG)
        assert feats.shape == (chunks, 128, 3000)
        np.testing.assert_allclose(feats[:, :, :: META["stride"]], gold[f"{key}/features"], atol=1e-4, rtol=0)


def test_text_only_chat_leaves_the_tower_unloaded_and_info_says_audio(host):
    assert host.info.audio and not host.info.vision and host.info.family == "voxtral"
    result = host.generate("t", [{"role": "user", "content": "what is said"}], GenerationParams(max_tokens=3))
    assert len(result.token_ids) == 3
    assert not host.tower_loaded and host.towers.encode_calls == 0
    info = inspect_model(FOLDER)
    assert info.family == "voxtral" and info.audio and not info.vision


def test_prompt_layout_matches_the_reference_without_loading_the_tower(host, shared_data, gold):
    chat = host.session("layout")
    template_messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    assert chat.render(template_messages) == META["prompt_text"]
    prompt = chat.media_prompt(
        chat.render(template_messages), [MediaInput("audio", str(shared_data / "audio/jfk.wav"))]
    )
    assert prompt.ids == gold["prompt/ids"].tolist()
    assert [(s.start, s.end - s.start) for s in prompt.spans] == [(prompt.ids.index(AUDIO_ID), 375)]
    assert not host.tower_loaded


def test_projected_audio_matches_for_one_and_two_chunks(host, clips, gold):
    tower = host.towers.encoder("audio").load()
    for key in ("short", "long"):
        projected = np.array(tower.embed_audio(clips[key]))
        assert projected.shape == gold[f"{key}/projected"].shape == (META["audio_tokens"][key], 48)
        np.testing.assert_allclose(projected, gold[f"{key}/projected"], atol=1e-4, rtol=0)


def test_audio_chat_gives_transformers_greedy_ids_and_logprobs(shared_data, gold):
    h = ModelHost()
    h.load(str(FOLDER))
    result = h.generate("a", ask(str(shared_data / "audio/jfk.wav")), PARAMS)
    assert result.token_ids == gold["greedy/ids"].tolist()
    np.testing.assert_allclose(result.token_logprobs, gold["greedy/logprobs"], atol=2e-3)
    assert result.stats.prompt_tokens == len(gold["prompt/ids"])
    assert h.tower_loaded and h.towers.encode_calls == 1
    again = h.generate("a", ask((shared_data / "audio/jfk.wav").read_bytes()), PARAMS)
    assert again.token_ids == result.token_ids and h.towers.encode_calls == 1  # keyed by content


def v5_name(name: str) -> str:
    """The Hub names save_pretrained writes -> transformers 5's in-memory spelling."""
    for old, new in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("audio_tower.", "model.audio_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def test_transformers_5_weight_names_load_too(tmp_path, shared_data, gold):
    folder = tmp_path / "v5"
    shutil.copytree(FOLDER, folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({v5_name(k): v for k, v in weights.items()}, str(folder / "model.safetensors"))
    h = ModelHost()
    h.load(str(folder))
    result = h.generate("a", ask(str(shared_data / "audio/jfk.wav")), PARAMS)
    assert result.token_ids == gold["greedy/ids"].tolist()


def test_an_mlx_conversion_with_quantized_layers_and_channels_last_convs_loads(tmp_path, clips, gold):
    """What an MLX conversion holds: conv kernels already channels-last, Linear layers
    8-bit quantized with scales and biases (where the width divides by the group)."""
    folder = tmp_path / "q8"
    shutil.copytree(FOLDER, folder)
    weights = {k: mx.array(v) for k, v in load_file(str(folder / "model.safetensors")).items()}
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if name.endswith(("conv1.weight", "conv2.weight")):
            w = w.transpose(0, 2, 1)
        elif name.endswith(".weight") and w.ndim == 2 and "embed_positions" not in name and w.shape[1] % 32 == 0:
            q, scales, biases = mx.quantize(w, group_size=32, bits=8)
            base = name[: -len(".weight")]
            out[base + ".scales"], out[base + ".biases"] = np.array(scales), np.array(biases)
            w = q
        out[name] = np.ascontiguousarray(np.array(w))
    save_file(out, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))
    h = ModelHost()
    h.load(str(folder))
    tower = h.towers.encoder("audio").load()
    assert type(tower.projector.linear_1).__name__ == "QuantizedLinear"
    projected = np.array(tower.embed_audio(clips["short"]))
    scale = np.abs(gold["short/projected"]).max()
    assert np.abs(projected - gold["short/projected"]).max() < 0.02 * scale
    result = h.generate("q", ask(None, "what is said"), GenerationParams(max_tokens=2))
    assert len(result.token_ids) == 2


def test_empty_and_overlong_clips_are_refused_before_any_weights():
    with pytest.raises(MediaError, match="empty"):
        clip_features(np.zeros(0, np.float32), CFG)
    with pytest.raises(MediaError, match="at most 40"):
        clip_features(np.zeros(41 * 60 * 16000, np.float32), CFG)


def test_tower_weights_stay_out_of_the_language_model(host):
    from mlx.utils import tree_flatten

    names = [n for n, _ in tree_flatten(host._need().model.parameters())]
    assert names and not [n for n in names if "audio" in n or "projector" in n or "conv" in n]


TEKKEN = GOLDEN / "tekken"


@pytest.fixture(scope="module")
def tekken_folder(tmp_path_factory) -> Path:
    """The tiny Voxtral as Mistral publishes it: tekken.json (Voxtral's 36 special tokens
    and the byte tokens, cut to the model's 160 ids), no tokenizer.json, no template."""
    folder = tmp_path_factory.mktemp("voxtral_tekken")
    for item in FOLDER.iterdir():
        if item.name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(item, folder / item.name)
    shutil.copy(TEKKEN / "voxtral_tekken.json", folder / "tekken.json")
    return folder


def test_a_tekken_only_folder_chats_with_audio_in_mistral_commons_layout(tekken_folder, shared_data, gold):
    vectors = json.loads((TEKKEN / "vectors.json").read_text(encoding="utf-8"))
    reference = vectors["chats"]["voxtral/v7/audio"]["ids"]  # mistral-common's encode_chat_completion
    h = ModelHost()
    h.load(str(tekken_folder))
    assert h.info.chat_template and h.info.audio and h.tokenizer.vocab_size == 160
    chat = h.session("tekken")
    clip = MediaInput("audio", str(shared_data / "audio/jfk.wav"))
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    prompt = chat.media_prompt(chat.render(messages), [clip])
    assert prompt.ids == reference
    assert [(s.start, s.end - s.start) for s in prompt.spans] == [(3, 375)]
    # The same audio layout as the Jinja template path of the tokenizer.json folder; only the
    # text's ids differ (words there, bytes here).
    template_ids = gold["prompt/ids"].tolist()
    assert prompt.ids[:378] == template_ids[:378] and prompt.ids[-1] == template_ids[-1] == 4
    assert h.tokenizer.decode(prompt.ids[378:-1]) == QUESTION
    result = h.generate("a", ask(str(shared_data / "audio/jfk.wav")), PARAMS)
    assert result.stats.prompt_tokens == len(reference) and len(result.token_ids) == META["steps"]
    assert h.tower_loaded and h.towers.encode_calls == 1
