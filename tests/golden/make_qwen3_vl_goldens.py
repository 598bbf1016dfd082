"""Make the references the Qwen3-VL tests compare against (needs torch, transformers 5.23,
torchvision's Python code and PyAV; see the reference-environment notes).

Builds tiny random Qwen3VLForConditionalGeneration and Qwen3VLMoeForConditionalGeneration
models and writes complete model folders under tests/golden/qwen3_vl/<name>/ (weights as
saved by save_pretrained, config.json, the processor's own configs as Qwen3VLProcessor
saves them, a small BPE tokenizer with the model's special tokens, a Qwen3-VL chat
template). Every config value that has a default is set to something else (RoPE bases,
eps, mRoPE sections, DeepStack layers, a 4 x 4 position table the grids must be
interpolated from). expected.json records, for ../shared/data/images/chelsea.png and for
the clip of tests/engine/media/clips.py (sampled by the real video processor from
frames PyAV decodes):

- pixel values (sha256 of the float32 bytes, sum) and grids from the processors,
- tower features (merged + DeepStack, side by side),
- the prompt ids as Qwen3VLProcessor expands them (timestamps for the video),
- 3-D position ids (get_rope_index),
- greedy ids with their log-probabilities (checked equal to the uncached run) and each
  step's top-2 margin.

Also the processors' output on the shared photos at the published Qwen3-VL settings.

    PYTHONPATH=<torchvision python code> /path/to/python tests/golden/make_qwen3_vl_goldens.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine" / "media"))
from clips import make_clip  # noqa: E402  (found through the path set just above)
from golden_common import (  # noqa: E402
    bpe_tokenizer,
    digest,
    fast_tokenizer,
    media_greedy,
    saved_and_reloaded,
    template_in_tokenizer_config,
)

OUT = HERE / "qwen3_vl"
IMAGES = HERE.parents[1].parent / "shared" / "data" / "images"
IMAGE = IMAGES / "chelsea.png"
NEW_TOKENS = 10

# The user-turn part of Qwen3-VL-Instruct's chat template (no default system prompt;
# vision markers around each placeholder).
TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}{%- if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CORPUS = [
    "What is in this picture? A cat sits on the floor and looks at the camera.",
    "What happens in this video? seconds 0.2 1.2 2.0 2.2 <0.5 seconds> frames move",
    "user model assistant system picture image photo describe it please",
] * 4
IMAGE_CFG = {
    "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 12},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
VIDEO_CFG = {
    "size": {"shortest_edge": 4096, "longest_edge": 32 * 32 * 200},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "fps": 2,
    "min_frames": 4,
    "max_frames": 8,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "cap_pixels_per_frame": False,
}
# Qwen/Qwen3-VL-*-Instruct's published preprocessor settings.
PUBLISHED_IMAGE = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def tokenizer():
    return bpe_tokenizer(SPECIALS, CORPUS)


def randomize(model: torch.nn.Module, seed: int, scale: float) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases start at constants: make them matter
                p.add_(0.1 * torch.randn_like(p))
            elif not p.any():
                p.normal_(0.0, 0.2)
            else:
                p.mul_(scale)


def marker_ids(ids: dict[str, int]) -> dict[str, int]:
    """The image and video placeholders' and the vision markers' ids, as the configs name them."""
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def config(name: str, ids: dict[str, int]):
    vision = dict(
        depth=3,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 2],
        hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "axial", "rope_theta": 2000.0},
    )
    text = dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 50000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    common = marker_ids(ids)
    if name == "qwen3_vl":
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **common)
    text.update(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[1]
    )
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **common)


def build(name: str, folder: Path, clip: Path) -> dict:
    tok = tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = config(name, ids)
    cls = (
        transformers.Qwen3VLForConditionalGeneration
        if name == "qwen3_vl"
        else transformers.Qwen3VLMoeForConditionalGeneration
    )
    torch.manual_seed(0)
    model = cls(cfg).eval().float()
    model.config._attn_implementation = "eager"
    randomize(model, 5, scale=4.0)
    model = saved_and_reloaded(model, cls, folder)
    model.config._attn_implementation = "eager"
    hf_tok = hf_tokenizer(tok)
    processor = save_processor(folder, hf_tok)
    return record_cases(name, model, processor, hf_tok, clip)


def hf_tokenizer(tok) -> transformers.PreTrainedTokenizerFast:
    return fast_tokenizer(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def save_processor(folder: Path, hf_tok) -> transformers.Qwen3VLProcessor:
    """Qwen3VLProcessor (PIL image backend) saved into the model folder, the chat template
    in tokenizer_config.json."""
    processor = transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessorPil(**IMAGE_CFG),
        tokenizer=hf_tok,
        video_processor=transformers.Qwen3VLVideoProcessor(**VIDEO_CFG),
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(folder)
    template_in_tokenizer_config(folder, TEMPLATE)
    return processor


def record_cases(name: str, model, processor, hf_tok, clip: Path) -> dict:
    """expected.json's cases (the photo, the clip, both) for a model of the Qwen3-VL tower
    family: pixels, grids, features (merged, then any DeepStack), prompt ids, positions,
    greedy ids with log-probs and margins."""
    image = Image.open(IMAGE).convert("RGB")
    frames, metadata = transformers.video_utils.load_video(str(clip), backend="pyav")
    cases = {
        "image": ([{"type": "image"}, {"type": "text", "text": "What is in this picture?"}], {"images": [image]}),
        "video": (
            [{"type": "video"}, {"type": "text", "text": "What happens in this video?"}],
            {"videos": [frames], "video_metadata": [metadata], "do_sample_frames": True},
        ),
        "both": (
            [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Describe both."}],
            {"images": [image], "videos": [frames], "video_metadata": [metadata], "do_sample_frames": True},
        ),
    }
    out: dict = {"image": IMAGE.name}
    for case, (content, media) in cases.items():
        messages = [{"role": "user", "content": content}]
        text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATE)
        inputs = processor(text=[text], return_tensors="pt", **media)
        record: dict = {"messages": messages, "prompt_ids": inputs["input_ids"][0].tolist()}
        with torch.no_grad():
            kwargs = {}
            for kind, key, grid_key in (
                ("image", "pixel_values", "image_grid_thw"),
                ("video", "pixel_values_videos", "video_grid_thw"),
            ):
                if key not in inputs:
                    continue
                record[f"{kind}_pixels"] = digest(inputs[key])
                record[f"{kind}_grid"] = inputs[grid_key][0].tolist()
                vision = model.model.visual(inputs[key], grid_thw=inputs[grid_key], return_dict=True)
                if case == kind:  # the first frame group's (or the image's) features, to keep the file small
                    n = int(inputs[grid_key][0, 1:].prod()) // 4
                    deepstack = getattr(vision, "deepstack_features", None) or []
                    record[f"{kind}_features"] = torch.cat([vision.pooler_output, *deepstack], dim=-1)[:n].tolist()
                kwargs[grid_key] = inputs[grid_key]
            positions, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], **kwargs)
        record["position_ids"] = positions[:, 0].tolist()
        record["rope_delta"] = int(delta[0, 0])
        record["token_ids"], record["token_logprobs"], record["margins"] = media_greedy(model, inputs, NEW_TOKENS)
        out[case] = record
        print(
            f"{name} {case}: {len(record['prompt_ids'])} prompt ids, greedy {record['token_ids']}, "
            f"min margin {min(record['margins']):.2e}"
        )
    return out


def processors(clip: Path) -> dict:
    """The processors alone on every shared photo (published settings) and on the clip."""
    proc = transformers.Qwen2VLImageProcessorPil(**PUBLISHED_IMAGE)
    photos = {}
    for path in sorted(IMAGES.iterdir()):
        if path.suffix.lower() not in (".png", ".jpg"):
            continue
        v = proc([Image.open(path).convert("RGB")], return_tensors="pt")
        photos[path.name] = {"pixels": digest(v["pixel_values"]), "grid": v["image_grid_thw"][0].tolist()}
    frames, metadata = transformers.video_utils.load_video(str(clip), backend="pyav")
    video = transformers.Qwen3VLVideoProcessor(**VIDEO_CFG)(
        videos=[frames], video_metadata=[metadata], do_sample_frames=True, return_metadata=True, return_tensors="pt"
    )
    meta = video["video_metadata"][0]
    return {
        "settings": PUBLISHED_IMAGE,
        "photos": photos,
        "clip": {
            "pixels": digest(video["pixel_values_videos"]),
            "grid": video["video_grid_thw"][0].tolist(),
            "indices": [int(i) for i in meta.frames_indices],
            "fps": float(meta.fps),
            "total_frames": int(meta.total_num_frames),
        },
    }


def main() -> None:
    if not IMAGE.is_file():
        sys.exit(f"{IMAGE} is missing")
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        clip = make_clip(Path(tmp) / "clip.mov", IMAGES)
        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        (OUT / "processors.json").write_text(json.dumps({**processors(clip), "versions": versions}, indent=1))
        for name in ("qwen3_vl", "qwen3_vl_moe"):
            expected = build(name, OUT / name, clip)
            expected["versions"] = versions
            (OUT / name / "expected.json").write_text(json.dumps(expected))
            size = sum(f.stat().st_size for f in (OUT / name).iterdir())
            print(f"{name}: {size} bytes")


if __name__ == "__main__":
    main()
