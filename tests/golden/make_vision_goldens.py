"""Make the references the vision tests compare against (needs torch + transformers).

For Gemma 3 and Qwen2.5-VL it builds a tiny random ...ForConditionalGeneration, writes
a complete model folder under tests/golden/vision/<name>/ (float32 safetensors in
transformers' own layout, config.json, preprocessor_config.json, a small BPE tokenizer
holding the model's special tokens, and the chat template published with the real
checkpoints), and records in expected.json, for ../shared/data/images/chelsea.png:

- the image features (tower + projector output) for pixel values made by transformers'
  image processor (PIL backend),
- the prompt ids after the processor's placeholder expansion (done as the processor
  does it: a text replacement before tokenizing) and where the image tokens sit,
- Qwen2.5-VL's 3-D position ids (get_rope_index),
- transformers' greedy continuation and each chosen token's log-probability.

    /path/to/python tests/golden/make_vision_goldens.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
OUT = HERE / "vision"
IMAGE = HERE.parents[1].parent / "shared" / "data" / "images" / "chelsea.png"
NEW_TOKENS = 10
QUESTION = "What is in this picture?"

# The chat templates published with google/gemma-3-*-it and Qwen/Qwen2.5-VL-*-Instruct.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    '    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content "
    "or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' "
    "or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is in this picture? A cat sits on the floor and looks at the camera.",
    "The quick brown fox jumps over the lazy dog. You are a helpful assistant.",
    "user model assistant system picture image photo describe it please",
] * 4


def tokenizer(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=240,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def randomize(model: torch.nn.Module, seed: int, scale: float = 2.0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases start at constants: make them matter
                p.add_(0.1 * torch.randn_like(p))
            elif not p.any():  # Gemma 3's projection starts at zero
                p.normal_(0.0, 0.2)
            else:
                p.mul_(scale)


def greedy(model, **inputs) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    n = inputs["input_ids"].shape[1]
    ids = out.sequences[0, n:].tolist()
    lps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids)]
    return ids, lps


def save_folder(folder: Path, model, tok: Tokenizer, tok_config: dict, preprocessor: dict) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    for extra in ("generation_config.json",):
        (folder / extra).unlink(missing_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))


def render(folder: Path, messages: list) -> tuple[str, object]:
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), hf_tok


def gemma3() -> dict:
    specials = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ]
    tok = tokenizer(specials)
    ids = {s: tok.token_to_id(s) for s in specials}
    config = transformers.Gemma3Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            query_pre_attn_scalar=16,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            vision_use_head=False,
            layer_norm_eps=1e-6,
        ),
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        pad_token_id=ids["<pad>"],
    )
    config.text_config.bos_token_id, config.text_config.eos_token_id = ids["<bos>"], ids["<eos>"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval().float()
    model.config._attn_implementation = "eager"
    randomize(model, 1)
    folder = OUT / "gemma3"
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": 32, "width": 32},
        "resample": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "rescale_factor": 1 / 255,
        "do_pan_and_scan": False,
    }
    save_folder(
        folder,
        model,
        tok,
        {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "add_bos_token": False,
            "chat_template": GEMMA3_TEMPLATE,
        },
        preprocessor,
    )

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text, hf_tok = render(folder, messages)
    soft = "<image_soft_token>" * config.mm_tokens_per_image
    text = text.replace("<start_of_image>", f"\n\n<start_of_image>{soft}<end_of_image>\n\n")
    input_ids = torch.tensor([hf_tok(text, add_special_tokens=False)["input_ids"]])
    token_type_ids = (input_ids == config.image_token_index).long()
    proc = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, resample=2, do_pan_and_scan=False)
    pixels = proc([Image.open(IMAGE).convert("RGB")], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        feats = model.model.get_image_features(pixels).pooler_output[0]
    out_ids, lps = greedy(model, input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids)
    return {
        "image": IMAGE.name,
        "messages": messages,
        "prompt_ids": input_ids[0].tolist(),
        "image_positions": torch.nonzero(token_type_ids[0]).flatten().tolist(),
        "features": feats.tolist(),
        "token_ids": out_ids,
        "token_logprobs": lps,
    }


def qwen2_5_vl() -> dict:
    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    tok = tokenizer(specials)
    ids = {s: tok.token_to_id(s) for s in specials}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            tie_word_embeddings=True,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
            hidden_act="silu",
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval().float()
    model.config._attn_implementation = "eager"
    randomize(model, 3, scale=4.0)
    folder = OUT / "qwen2_5_vl"
    pixels_cfg = {
        "min_pixels": 28 * 28 * 4,
        "max_pixels": 28 * 28 * 15,
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", **pixels_cfg}
    save_folder(
        folder,
        model,
        tok,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN_VL_TEMPLATE},
        preprocessor,
    )

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text, hf_tok = render(folder, messages)
    proc = transformers.Qwen2VLImageProcessorPil(**pixels_cfg)
    vision = proc([Image.open(IMAGE).convert("RGB")], return_tensors="pt")
    grid = vision["image_grid_thw"]
    n = int(grid[0].prod()) // 4
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
    input_ids = torch.tensor([hf_tok(text, add_special_tokens=False)["input_ids"]])
    mm_types = (input_ids == config.image_token_id).int()
    with torch.no_grad():
        feats = model.model.get_image_features(vision["pixel_values"], grid).pooler_output[0]
        positions, delta = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
    out_ids, lps = greedy(
        model, input_ids=input_ids, pixel_values=vision["pixel_values"], image_grid_thw=grid, mm_token_type_ids=mm_types
    )
    return {
        "image": IMAGE.name,
        "messages": messages,
        "prompt_ids": input_ids[0].tolist(),
        "image_positions": torch.nonzero(mm_types[0]).flatten().tolist(),
        "grid_thw": grid[0].tolist(),
        "position_ids": positions[:, 0].tolist(),
        "rope_delta": int(delta[0, 0]),
        "features": feats.tolist(),
        "token_ids": out_ids,
        "token_logprobs": lps,
    }


def main() -> None:
    if not IMAGE.is_file():
        sys.exit(f"{IMAGE} is missing")
    OUT.mkdir(exist_ok=True)
    for name, make in (("gemma3", gemma3), ("qwen2_5_vl", qwen2_5_vl)):
        expected = make()
        expected["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
        (OUT / name / "expected.json").write_text(json.dumps(expected))
        size = sum(f.stat().st_size for f in (OUT / name).iterdir())
        print(f"{name}: {len(expected['prompt_ids'])} prompt ids, greedy {expected['token_ids']}, {size} bytes")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
