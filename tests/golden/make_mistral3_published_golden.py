"""Write the Mistral 3 golden (tests/golden/mistral3, made by make_mistral3_goldens.py) in
the published repos' spelling, under tests/golden/mistral3_published/, and check with
transformers 5.23 that it is the same model (needs torch, transformers and torchvision's
Python code; see the reference-environment notes).

The published Mistral 3 repos (mistralai/Mistral-Small-3.1-24B-Instruct-2503 and its
successors, Pixtral tower, a ``mistral`` language model) were saved by transformers 4.5x:

- config.json: ``rope_theta`` flat in ``text_config`` and in ``vision_config`` (no
  ``rope_parameters`` blocks), ``torch_dtype`` instead of ``dtype``;
- the image processor's settings in preprocessor_config.json, and processor_config.json
  holding only the processor's own (patch size, merge size, the image tokens);
- the weights under ``language_model.model.*``, ``vision_tower.*`` and
  ``multi_modal_projector.*``, the names transformers 5.23 still saves.

The check: transformers loads both folders to equal weights and configs, its processor
gives equal ids and pixel values from both, and greedy decoding from the published
folder gives tests/golden/mistral3/expected.json's ids.

    PYTHONPATH=<torchvision python code> /path/to/python tests/golden/make_mistral3_published_golden.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from PIL import Image

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "mistral3"
OUT = HERE / "mistral3_published"
IMAGE = HERE.parents[1].parent / "shared" / "data" / "images" / "chelsea.png"


def flat_rope(block: dict) -> dict:
    """A transformers-5 config block with its ``rope_parameters`` written the 4.x way."""
    block = dict(block)
    params = block.pop("rope_parameters", None) or {}
    block["rope_theta"] = params["rope_theta"]
    return block


def write() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SOURCE / name, OUT / name)
    config = json.loads((SOURCE / "config.json").read_text())
    config["text_config"] = flat_rope(config["text_config"])
    config["vision_config"] = flat_rope(config["vision_config"])
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.50.0.dev0"
    (OUT / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    processor = json.loads((SOURCE / "processor_config.json").read_text())
    image = processor.pop("image_processor")
    image["processor_class"] = "PixtralProcessor"
    (OUT / "preprocessor_config.json").write_text(json.dumps(image, indent=2, sort_keys=True))
    (OUT / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True))


def check() -> None:
    cls = transformers.Mistral3ForConditionalGeneration
    ours, theirs = (cls.from_pretrained(f, dtype=torch.float32).eval() for f in (SOURCE, OUT))
    a, b = ours.state_dict(), theirs.state_dict()
    if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
        sys.exit("the published spelling loads other weights")
    same = {"transformers_version": 0, "_name_or_path": 0}
    if ours.config.to_dict() | same != theirs.config.to_dict() | same:
        sys.exit("the published spelling loads another config")
    expected = json.loads((SOURCE / "expected.json").read_text())
    image = Image.open(IMAGE).convert("RGB")
    inputs = []
    for folder in (SOURCE, OUT):
        processor = transformers.PixtralProcessor.from_pretrained(folder, backend="pil")
        text = processor.tokenizer.apply_chat_template(expected["messages"], tokenize=False)
        inputs.append(processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False))
    if inputs[0]["input_ids"].tolist() != inputs[1]["input_ids"].tolist():
        sys.exit("the published processor files expand the prompt differently")
    if not torch.equal(inputs[0]["pixel_values"], inputs[1]["pixel_values"]):
        sys.exit("the published processor files give other pixel values")
    if inputs[1]["input_ids"][0].tolist() != expected["prompt_ids"]:
        sys.exit("the prompt differs from expected.json's")
    theirs.config._attn_implementation = "eager"
    n = inputs[1]["input_ids"].shape[1]
    with torch.no_grad():
        out = theirs.generate(**inputs[1], max_new_tokens=len(expected["token_ids"]), do_sample=False, pad_token_id=0)
    if out[0, n:].tolist() != expected["token_ids"]:
        sys.exit("greedy ids from the published spelling differ from expected.json's")
    print(f"mistral3_published: same weights, config, prompt, pixels and greedy ids {expected['token_ids']}")


if __name__ == "__main__":
    if not IMAGE.is_file():
        sys.exit(f"{IMAGE} is missing")
    write()
    check()
