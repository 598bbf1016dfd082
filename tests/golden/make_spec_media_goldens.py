"""Make the reference the speculative-with-media tests compare against (needs torch + transformers).

The tiny Gemma 3 in tests/golden/vision/gemma3 has a 6-token sliding window, which a prompt
with an image has long rotated past; a rotated window cannot be rewound, so speculative
decoding turns itself off there. This script loads the same weights with the window widened
to 512 (longer than prompt and reply together: every cache can rewind), and records
transformers' greedy continuation for ../shared/data/images/chelsea.png in
tests/golden/media/gemma3_wide_window.json.

    /path/to/python tests/golden/make_spec_media_goldens.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from PIL import Image

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "vision" / "gemma3"
IMAGE = HERE.parents[1].parent / "shared" / "data" / "images" / "chelsea.png"
WINDOW = 512
NEW_TOKENS = 24


def main() -> None:
    expected = json.loads((FOLDER / "expected.json").read_text())
    config = transformers.AutoConfig.from_pretrained(FOLDER)
    config.text_config.sliding_window = WINDOW
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(FOLDER, config=config).eval().float()
    model.config._attn_implementation = "eager"
    input_ids = torch.tensor([expected["prompt_ids"]])
    token_type_ids = (input_ids == config.image_token_index).long()
    proc = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, resample=2, do_pan_and_scan=False)
    pixels = proc([Image.open(IMAGE).convert("RGB")], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            pixel_values=pixels,
            token_type_ids=token_type_ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    ids = out[0, input_ids.shape[1] :].tolist()
    record = {
        "image": IMAGE.name,
        "sliding_window": WINDOW,
        "prompt_ids": expected["prompt_ids"],
        "token_ids": ids,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (HERE / "media" / "gemma3_wide_window.json").write_text(json.dumps(record))
    print(f"gemma3, window {WINDOW}: greedy {ids}")


if __name__ == "__main__":
    main()
