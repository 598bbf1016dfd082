"""Make the references the Qwen3.5 image and video tests compare against (needs torch,
transformers 5.23, torchvision's Python code and PyAV; see the reference-environment notes).

Builds tiny random Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration
models and writes complete model folders under tests/golden/qwen3_5_media/<name>/ (weights
as saved by save_pretrained, config.json, the processor's configs, a small BPE tokenizer
with the model's special tokens, a Qwen3-VL style chat template). The processor is the
one transformers maps model_type qwen3_5 to (Qwen3VLProcessor: the Qwen2-VL image
processor, the Qwen3-VL video processor); the references use it as AutoProcessor loads it
back from the folder.

Every config value with a default is set to something else: gated DeltaNet sizes and
conv kernel, a partial rotary factor of one half, mRoPE sections, RoPE bases, eps, a
4 x 4 position table the grids are interpolated from, random norm weights (Qwen3.5's
norms are 1 + w). expected.json records, for ../shared/data/images/chelsea.png and for
the clip of tests/engine/media/clips.py (sampled by the real video processor), what
make_qwen3_vl_goldens.py records: pixel values (sha256 and sum), grids, tower features,
prompt ids, 3-D position ids, greedy ids with log-probabilities and top-2 margins.

    PYTHONPATH=<torchvision python code> /path/to/python tests/golden/make_qwen3_5_media_goldens.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from golden_common import saved_and_reloaded  # noqa: E402
from make_qwen3_vl_goldens import (  # noqa: E402  (a sibling script, found through the path just set)
    IMAGE,
    IMAGES,
    SPECIALS,
    TEMPLATE,
    hf_tokenizer,
    make_clip,
    marker_ids,
    randomize,
    record_cases,
    save_processor,
    tokenizer,
)

OUT = HERE / "qwen3_5_media"
FAMILIES = ("qwen3_5", "qwen3_5_moe")
SEEDS = {"qwen3_5": 31, "qwen3_5_moe": 32}


def config(name: str, ids: dict[str, int]):
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=48,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
        hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "axial", "rope_theta": 2000.0},
    )
    text = dict(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=3,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 50000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    common = marker_ids(ids)
    if name == "qwen3_5":
        return transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **common)
    del text["intermediate_size"]
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **common)


def build(name: str, folder: Path, clip: Path) -> dict:
    tok = tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = config(name, ids)
    cls = (
        transformers.Qwen3_5ForConditionalGeneration
        if name == "qwen3_5"
        else transformers.Qwen3_5MoeForConditionalGeneration
    )
    torch.manual_seed(0)
    model = cls(cfg).eval().float()
    randomize(model, SEEDS[name], scale=2.0)
    with torch.no_grad():  # a decay that keeps the recurrent state in a useful range
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 0.5)
    model = saved_and_reloaded(model, cls, folder)
    model.config._attn_implementation = "eager"
    hf_tok = hf_tokenizer(tok)
    save_processor(folder, hf_tok)
    # The classes transformers maps this model_type to, the image processor on its PIL
    # backend (the one the engine mirrors; AutoProcessor prefers torchvision when it imports),
    # read back from the folder.
    auto = transformers.models.auto
    assert auto.processing_auto.PROCESSOR_MAPPING_NAMES[name] == "Qwen3VLProcessor"
    assert auto.image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES[name]["pil"] == "Qwen2VLImageProcessorPil"
    assert auto.video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES[name]["torchvision"] == "Qwen3VLVideoProcessor"
    processor = transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=hf_tok,
        video_processor=transformers.Qwen3VLVideoProcessor.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    out = record_cases(name, model, processor, hf_tok, clip)
    vision_ids = {ids[s] for s in SPECIALS[3:]}
    for case in ("image", "video", "both"):
        if set(out[case]["token_ids"]) & vision_ids:  # the uncached reference would misplace media
            sys.exit(f"{name} {case}: the reply holds a vision token; pick another seed")
    return out


def main() -> None:
    if not IMAGE.is_file():
        sys.exit(f"{IMAGE} is missing")
    OUT.mkdir(exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        clip = make_clip(Path(tmp) / "clip.mov", IMAGES)
        for name in FAMILIES:
            expected = build(name, OUT / name, clip)
            expected["versions"] = versions
            (OUT / name / "expected.json").write_text(json.dumps(expected))
            size = sum(f.stat().st_size for f in (OUT / name).iterdir())
            print(f"{name}: {size} bytes")


if __name__ == "__main__":
    main()
