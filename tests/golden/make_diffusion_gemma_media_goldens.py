"""Make the DiffusionGemma image reference (tests/golden/diffusion_gemma/diffusion_gemma_image/).

Needs torch, transformers 5.23 and torchvision's Python code (Gemma4Processor, which
transformers uses for DiffusionGemma, builds only with it; see the reference-environment
notes). A tiny random ``DiffusionGemmaForBlockDiffusion`` like the text goldens' (same
text config, sharpened decoder) with Gemma 4's vision tower as the Gemma 4 media golden
configures it (GQA, 2 x 2 pooling, clipped linears, standardised soft tokens), saved with
the real processor's configs, a small BPE tokenizer carrying Gemma 4's media tokens and a
Gemma 4 style chat template: a complete model folder the engine loads.

diffusion.json records, for ../shared/data/images/chelsea.png under one chat message:

- the prompt ids as Gemma4Processor expands them, and the image's soft-token count;
- the image features in the language model's width (the tower's output);
- transformers' own block-diffusion ``generate`` with every random draw it made, as in
  make_diffusion_gemma_goldens.py (the same draws must give the same ids and steps).

reference.safetensors holds the decoder's logits for a fixed canvas after the prompt.

    PYTHONPATH=<torchvision python code> /path/to/python tests/golden/make_diffusion_gemma_media_goldens.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from golden_common import fast_tokenizer, pretrained_files, template_in_tokenizer_config, write_config
from make_diffusion_gemma_goldens import CANVAS, GENERATION, MARGIN, TEXT, build, generate
from make_gemma4_media_goldens import (
    AUDIO_CFG,
    IMAGE,
    IMAGE_CFG,
    MEDIA,
    SPECIALS,
    TEMPLATE,
    VISION,
    rounded,
    tokenizer,
)
from PIL import Image
from safetensors.torch import save_file
from transformers import DiffusionGemmaForBlockDiffusion

OUT = Path(__file__).resolve().parent / "diffusion_gemma" / "diffusion_gemma_image"
SETTINGS = dict(GENERATION, stability_threshold=0)  # confidence alone stops a block (see the text goldens)
PROMPT = "What is in this picture?"


def processor_and_tokenizer(folder: Path):
    tok = tokenizer()
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
    return processor, hf_tok, {s: tok.token_to_id(s) for s in SPECIALS}


def encoded_then_denoised(model, prompt: list[int], canvas, inputs: dict, marked: bool):
    """The decoder's logits for ``canvas`` after the prompt is encoded as generate() encodes
    it: with the mask mapping that lets each image's tokens see each other (``marked``)."""
    cache = transformers.DynamicCache(config=model.config.get_text_config(decoder=True))
    n = len(prompt)
    positions = torch.arange(n, dtype=torch.int32)[None]
    mapping = model.model.encoder.create_masks_for_generate(
        config=model.config,
        inputs_embeds=torch.empty((1, n, 0), dtype=model.dtype),
        attention_mask=torch.ones((1, n), dtype=torch.bool),
        past_key_values=cache,
        position_ids=positions,
        mm_token_type_ids=inputs["mm_token_type_ids"] if marked else None,
    )
    model.model.encoder(
        input_ids=torch.tensor([prompt]),
        attention_mask=mapping,
        past_key_values=cache,
        position_ids=positions,
        pixel_values=inputs["pixel_values"],
        image_position_ids=inputs["image_position_ids"],
    )
    return model(past_key_values=cache, decoder_input_ids=canvas).logits


def main() -> None:
    if not IMAGE.is_file():
        sys.exit(f"{IMAGE} is missing")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    processor, hf_tok, ids = processor_and_tokenizer(OUT)
    # The text goldens' special ids (pad 0, eos 1, bos 2) are the tokenizer's too.
    assert (ids["<pad>"], ids["<eos>"], ids["<bos>"]) == (TEXT["pad_token_id"], TEXT["eos_token_id"], 2)
    image_ids = (ids[MEDIA["image_token"]], ids[MEDIA["boi_token"]], ids[MEDIA["eoi_token"]])

    image = Image.open(IMAGE).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATE)
    inputs = dict(processor(text=[text], images=[image], return_tensors="pt"))
    print(sorted(inputs))
    inputs.pop("num_soft_tokens_per_image", None)
    prompt = inputs.pop("input_ids")[0].tolist()
    n_soft = prompt.count(image_ids[0])
    inputs.pop("attention_mask", None)
    assert "mm_token_type_ids" in inputs, "the processor no longer marks the image tokens"

    # A seed under which the reference writes at least two blocks, with no decision near a tie.
    for seed in range(200):
        model = build(seed, VISION, image_ids)
        trial = generate(model, prompt, SETTINGS, **inputs)
        print(seed, trial["steps_per_block"], trial["min_margin"])
        if trial["min_margin"] >= MARGIN and len(trial["steps_per_block"]) >= 2:
            break
    else:
        sys.exit("no seed gave two blocks without a near-tie")

    config, tmp = pretrained_files(model)
    shutil.copy(tmp / "model.safetensors", OUT / "model.safetensors")
    shutil.rmtree(tmp)
    write_config(OUT, config)

    # The references come from what transformers reads back from the files as written.
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(OUT, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    canvas = torch.randint(0, TEXT["vocab_size"], (1, CANVAS), generator=gen)
    with torch.no_grad():
        features = model.model.encoder.get_image_features(
            inputs["pixel_values"], inputs["image_position_ids"], return_dict=True
        ).pooler_output
        first = encoded_then_denoised(model, prompt, canvas, inputs, marked=True)
        # transformers' forward() drops the mask that marks the image runs (it builds it
        # and discards it), so only generate() attends both ways within an image; the
        # unmarked logits must differ, or the reference would not show that the engine does.
        causal = encoded_then_denoised(model, prompt, canvas, inputs, marked=False)
    gap = float((first - causal).abs().max())
    assert gap > 0.05, f"bidirectional and causal image attention barely differ ({gap})"
    save_file({"first_logits": first[0].contiguous()}, str(OUT / "reference.safetensors"))
    result = generate(model, prompt, SETTINGS, **inputs)
    expected = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "image_file": IMAGE.name,
        "messages": messages,
        "prompt_ids": prompt,
        "image_soft_tokens": n_soft,
        "image_features": rounded(features.reshape(-1, features.shape[-1])),
        "forward_canvas": canvas[0].tolist(),
        "bidirectional_gap": gap,
        "generation": SETTINGS,
        **result,
    }
    (OUT / "diffusion.json").write_text(json.dumps(expected) + "\n")
    size = sum(p.stat().st_size for p in OUT.iterdir())
    print(
        f"{size // 1024} KB, {n_soft} soft tokens, steps {result['steps_per_block']}, ids {result['sequences'][len(prompt) :]}"
    )


if __name__ == "__main__":
    main()
