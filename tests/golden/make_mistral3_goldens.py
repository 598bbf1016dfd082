"""Make the references the Mistral 3 image tests compare against (needs torch,
transformers 5.23 and torchvision's Python code; see the reference-environment notes).

A tiny random Mistral3ForConditionalGeneration whose text_config is a plain ``mistral``
model (sliding window shorter than the prompt), with a Pixtral tower (non-default RoPE
base, the second-to-last layer's output as features, a projector with biases), saved
bf16 under tests/golden/mistral3/ with PixtralProcessor's configs (PIL image backend), a
small BPE tokenizer holding Mistral's special tokens and a Mistral-style chat template
that writes ``[IMG]`` for an image part. expected.json records, for
../shared/data/images/chelsea.png: the processor's pixel values (sha256 of the float32
bytes) and size, the tower + projector features, the prompt ids as PixtralProcessor
expands them (rows of [IMG] ended by [IMG_BREAK], the last by [IMG_END]), and greedy ids
with log-probabilities (cached and uncached agreeing) and top-2 margins. The references
run in float32 on the model read back from disk.

    PYTHONPATH=<torchvision python code> /path/to/python tests/golden/make_mistral3_goldens.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from golden_common import bpe_tokenizer, fast_tokenizer, media_greedy, template_in_tokenizer_config
from PIL import Image

HERE = Path(__file__).resolve().parent
OUT = HERE / "mistral3"
IMAGE = HERE.parents[1].parent / "shared" / "data" / "images" / "chelsea.png"
NEW_TOKENS = 10
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message.role == 'user' %}[INST]"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}[IMG]{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}[/INST]{%- else %}{{- message.content }}{{- eos_token }}{%- endif %}{%- endfor %}"
)
CORPUS = [
    "What is in this picture? A cat sits on the floor and looks at the camera.",
    "user model assistant system picture image photo describe it please",
] * 4
IMAGE_CFG = {"size": {"longest_edge": 64}, "patch_size": {"height": 8, "width": 8}}


def main() -> None:
    if not IMAGE.is_file():
        sys.exit(f"{IMAGE} is missing")
    tok = bpe_tokenizer(SPECIALS, CORPUS)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = transformers.Mistral3Config(
        text_config={
            "model_type": "mistral",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 256,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5,
            "sliding_window": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["</s>"],
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "head_dim": 16,
            "patch_size": 8,
            "image_size": 64,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "axial", "rope_theta": 5000.0},
        },
        image_token_index=ids["[IMG]"],
        spatial_merge_size=2,
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
    )
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval().float()
    torch.manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    folder = OUT
    if folder.exists():
        shutil.rmtree(folder)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    hf_tok = fast_tokenizer(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    processor = transformers.PixtralProcessor(
        image_processor=transformers.PixtralImageProcessorPil(**IMAGE_CFG),
        tokenizer=hf_tok,
        patch_size=8,
        spatial_merge_size=2,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(folder)
    template_in_tokenizer_config(folder, TEMPLATE, add_bos_token=False)

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, chat_template=TEMPLATE)
    inputs = processor(
        text=[text], images=[Image.open(IMAGE).convert("RGB")], return_tensors="pt", add_special_tokens=False
    )
    pixels = inputs["pixel_values"][0].float().contiguous().numpy()
    with torch.no_grad():
        feats = model.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"], vision_feature_layer=-2
        ).pooler_output[0]
    n = inputs["input_ids"].shape[1]
    token_ids, lps, margins = media_greedy(model, inputs, NEW_TOKENS)
    expected = {
        "image": IMAGE.name,
        "messages": messages,
        "prompt_ids": inputs["input_ids"][0].tolist(),
        "image_size": inputs["image_sizes"][0].tolist(),
        "pixels": {
            "sha256": hashlib.sha256(pixels.tobytes()).hexdigest(),
            "shape": list(pixels.shape),
            "sum": float(pixels.astype(np.float64).sum()),
        },
        "features": feats.tolist(),
        "token_ids": token_ids,
        "token_logprobs": lps,
        "margins": margins,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (folder / "expected.json").write_text(json.dumps(expected))
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"mistral3: {n} prompt ids, greedy {token_ids}, min margin {min(margins):.2e}, {size} bytes")


if __name__ == "__main__":
    main()
