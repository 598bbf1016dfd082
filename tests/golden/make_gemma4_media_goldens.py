"""Make the references the Gemma 4 image and audio tests compare against (needs torch,
transformers 5.23 and torchvision's Python code, which Gemma4Processor needs to build;
see the reference-environment notes).

Builds one tiny random Gemma4ForConditionalGeneration with a vision tower and a
Conformer audio tower and writes a complete model folder under
tests/golden/gemma4_media/ (weights as saved by save_pretrained in bf16, config.json,
the processor's own configs as Gemma4Processor saves them with its PIL image processor,
a small BPE tokenizer carrying Gemma 4's media tokens, a Gemma 4 style chat template).
Config values that have a default are set to something else: GQA in the vision tower,
a 2 x 2 pooling kernel, clipped linears with finite bounds, standardised soft tokens,
the audio tower's chunk and context sizes (right context included), its logit cap,
residual weight, gradient clipping and kernel size.

expected.json records, for ../shared/data/images/chelsea.png and ../shared/data/audio/jfk.wav:

- the image processor's pixel values (sha256 of the float32 bytes, sum), patch positions
  and soft-token count; the audio features (sha256, sum, every 50th frame) and mask,
- the tower outputs in the language model's width (the image's, the clip's first rows),
- the prompt ids as Gemma4Processor expands them for an image, a clip, and both,
- greedy ids with their log-probabilities (checked equal to the uncached run) and each
  step's top-2 margin.

    PYTHONPATH=<torchvision python code> /path/to/python tests/golden/make_gemma4_media_goldens.py
"""

from __future__ import annotations

import json
import sys
import wave
from pathlib import Path

import numpy as np
import torch
import transformers
from golden_common import (
    bpe_tokenizer,
    digest,
    fast_tokenizer,
    media_greedy,
    saved_and_reloaded,
    template_in_tokenizer_config,
)
from PIL import Image

HERE = Path(__file__).resolve().parent
OUT = HERE / "gemma4_media"
DATA = HERE.parents[1].parent / "shared" / "data"
IMAGE = DATA / "images" / "chelsea.png"
AUDIO = DATA / "audio" / "jfk.wav"
NEW_TOKENS = 10

# The user turn of Gemma 4's chat template: media placeholders where the parts are, text trimmed.
TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{{- '<|turn>' + role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content | trim }}{%- else %}"
    "{%- for item in message.content %}"
    "{%- if item.type == 'text' %}{{- item.text | trim }}"
    "{%- elif item.type == 'image' %}{{- '<|image|>' }}"
    "{%- elif item.type == 'audio' %}{{- '<|audio|>' }}"
    "{%- elif item.type == 'video' %}{{- '<|video|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<turn|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)
MEDIA = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", *MEDIA.values(), "<|video|>"]
CORPUS = [
    "What is in this picture? A cat sits on the floor and looks at the camera.",
    "What does the speaker say? And so my fellow Americans ask not what your country can do for you.",
    "user model describe both the picture and the voice note please",
] * 4
IMAGE_CFG = {"patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 2}
AUDIO_CFG = {"feature_size": 128, "sampling_rate": 16000}


# The image tower (GQA, 2 x 2 pooling, clipped linears, standardised soft tokens); DiffusionGemma's
# image goldens use the same.
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    patch_size=16,
    pooling_kernel_size=2,
    position_embedding_size=64,
    rms_norm_eps=1e-5,
    use_clipped_linears=True,
    standardize=True,
    rope_parameters={"rope_type": "axial", "rope_theta": 50.0},
)


def tokenizer():
    return bpe_tokenizer(SPECIALS, CORPUS)


def config(ids: dict[str, int]) -> transformers.Gemma4Config:
    text = dict(
        hidden_size=64,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        vocab_size_per_layer_input=256,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
        sliding_window=8,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=1,
        hidden_size_per_layer_input=8,
        final_logit_softcapping=20.0,
        global_head_dim=32,
        use_bidirectional_attention="vision",
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    )
    vision = dict(VISION)
    audio = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        subsampling_conv_channels=[128, 8],
        conv_kernel_size=3,
        residual_weight=0.3,
        attention_chunk_size=4,
        attention_context_left=6,
        attention_context_right=2,
        attention_logit_cap=20.0,
        rms_norm_eps=1e-5,
        gradient_clipping=40.0,
        output_proj_dims=48,
    )
    tokens = {k.replace("_token", "_token_id"): ids[v] for k, v in MEDIA.items() if k != "eoa_token"}
    tokens["eoa_token_index"] = ids[MEDIA["eoa_token"]]
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        video_token_id=ids["<|video|>"],
        tie_word_embeddings=True,
        **tokens,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases: make a (1 + w) vs w mix-up show
                p.add_(0.1 * torch.randn_like(p))
            elif "position_embedding_table" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
            if name.endswith("embed_tokens.weight"):
                p.mul_(0.2)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.empty_like(b).uniform_(0.6, 1.4))
            elif name.endswith(("input_min", "output_min")):  # clipped linears: bounds that bite
                b.fill_(-float(torch.empty(()).uniform_(0.8, 2.0)))
            elif name.endswith(("input_max", "output_max")):
                b.fill_(float(torch.empty(()).uniform_(0.8, 2.0)))
            elif name.endswith("std_bias"):
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("std_scale"):
                b.copy_(torch.empty_like(b).uniform_(0.5, 1.5))


def rounded(a) -> list:
    """Seven significant digits: far below the tests' tolerance, and a small file."""
    return [[float(f"{v:.7g}") for v in row] for row in np.asarray(a, dtype=np.float64).tolist()]


def read_wav(path: Path) -> np.ndarray:
    """16-bit mono PCM as float32 in [-1, 1), the way the engine reads it."""
    with wave.open(str(path)) as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1 and w.getframerate() == 16000
        raw = w.readframes(w.getnframes())
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def greedy(model, inputs) -> tuple[list[int], list[float], list[float]]:
    return media_greedy(model, inputs, NEW_TOKENS)


def build(folder: Path, seed: int) -> dict:
    tok = tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = config(ids)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval().float()
    randomize(model, seed)
    model = saved_and_reloaded(model, transformers.Gemma4ForConditionalGeneration, folder)
    hf_tok = fast_tokenizer(tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", extra_special_tokens=MEDIA)
    processor = transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(**AUDIO_CFG),
        image_processor=transformers.Gemma4ImageProcessorPil(**IMAGE_CFG),
        tokenizer=hf_tok,
        video_processor=transformers.Gemma4VideoProcessor(),
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(folder)
    template_in_tokenizer_config(folder, TEMPLATE)

    image = Image.open(IMAGE).convert("RGB")
    speech = read_wav(AUDIO)
    out: dict = {"image_file": IMAGE.name, "audio_file": AUDIO.name}
    pixels = processor.image_processor([image], return_tensors="pt")
    n_soft = int(pixels["num_soft_tokens_per_image"][0])
    positions = pixels["image_position_ids"][0]
    real = int((positions != -1).all(-1).sum())
    out["image_pixels"] = digest(pixels["pixel_values"][0, :real])
    out["image_positions"] = positions[:real].tolist()
    out["image_soft_tokens"] = n_soft
    feats = processor.feature_extractor([speech], return_tensors="np")
    mel, mask = feats["input_features"][0], feats["input_features_mask"][0]
    out["audio_features"] = {**digest(mel), "every_50th": rounded(mel[::50])}
    out["audio_mask"] = [int(mask.sum()), len(mask)]
    with torch.no_grad():
        image_out = model.model.get_image_features(
            pixels["pixel_values"], pixels["image_position_ids"], return_dict=True
        )
        out["image_features"] = rounded(torch.cat(image_out.pooler_output))
        audio_out = model.model.get_audio_features(torch.tensor(mel)[None], torch.tensor(mask)[None], return_dict=True)
        valid = audio_out.pooler_output[audio_out.attention_mask]
        out["audio_tokens"] = int(valid.shape[0])
        out["audio_rows"] = rounded(valid[:16])
    cases = {
        "image": ([{"type": "image"}, {"type": "text", "text": "What is in this picture?"}], {"images": [image]}),
        "audio": ([{"type": "audio"}, {"type": "text", "text": "What does the speaker say?"}], {"audio": [speech]}),
        "both": (
            [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Describe both."}],
            {"images": [image], "audio": [speech]},
        ),
    }
    for case, (content, media) in cases.items():
        messages = [{"role": "user", "content": content}]
        text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATE)
        inputs = processor(text=[text], return_tensors="pt", **media)
        inputs.pop("num_soft_tokens_per_image", None)
        record: dict = {"messages": messages, "prompt_ids": inputs["input_ids"][0].tolist()}
        record["token_ids"], record["token_logprobs"], record["margins"] = greedy(model, inputs)
        out[case] = record
        print(
            f"{case}: {len(record['prompt_ids'])} prompt ids, greedy {record['token_ids']}, "
            f"min margin {min(record['margins']):.2e}"
        )
    return out


def main() -> None:
    if not IMAGE.is_file() or not AUDIO.is_file():
        sys.exit(f"{IMAGE} or {AUDIO} is missing")
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 9  # every greedy margin above 2e-3
    expected = build(OUT, seed)
    expected["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    (OUT / "expected.json").write_text(json.dumps(expected))
    print(f"{sum(f.stat().st_size for f in OUT.iterdir())} bytes")


if __name__ == "__main__":
    main()
