"""Make the reference for Gemma 4 audio longer than 30 s (needs torch, transformers 5.23 and
torchvision's Python code, as make_gemma4_media_goldens.py does).

The clip is ../shared/data/audio/jfk.wav four times over (44 s). Gemma4Processor, built
from the tiny checkpoint in tests/golden/gemma4_media/ with its saved configs, is asked
with its defaults, which cut a clip at 480,000 samples (30 s). long_audio.json records:

- the seconds of the clip, and the features and mask the processor gives for it (sha256
  of the float32 bytes, sum, every 50th frame; valid frames and frames);
- the prompt ids it expands for one clip and a question, and the tiny model's greedy ids
  with their log-probabilities (checked equal to the uncached run) and top-2 margins.

    PYTHONPATH=<torchvision python code> /path/to/python tests/golden/make_gemma4_long_audio_goldens.py
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import transformers
from make_gemma4_media_goldens import AUDIO, OUT, TEMPLATE, digest, greedy, read_wav, rounded

REPEATS = 4


def main() -> None:
    if not AUDIO.is_file():
        sys.exit(f"{AUDIO} is missing")
    processor = transformers.AutoProcessor.from_pretrained(OUT)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(OUT, dtype=torch.float32).eval()
    speech = np.concatenate([read_wav(AUDIO)] * REPEATS)
    out: dict = {"audio_file": AUDIO.name, "repeats": REPEATS, "seconds": len(speech) / 16000}
    feats = processor.feature_extractor([speech], return_tensors="np")
    mel, mask = feats["input_features"][0], feats["input_features_mask"][0]
    out["audio_features"] = {**digest(mel), "every_50th": rounded(mel[::50])}
    out["audio_mask"] = [int(mask.sum()), len(mask)]
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What does the speaker say?"}]}
    ]
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATE
    )
    inputs = processor(text=[text], audio=[speech], return_tensors="pt")
    out["messages"] = messages
    out["prompt_ids"] = inputs["input_ids"][0].tolist()
    out["token_ids"], out["token_logprobs"], out["margins"] = greedy(model, inputs)
    out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    (OUT / "long_audio.json").write_text(json.dumps(out))
    print(
        f"{out['seconds']} s: mask {out['audio_mask']}, {len(out['prompt_ids'])} prompt ids, "
        f"greedy {out['token_ids']}, min margin {min(out['margins']):.2e}"
    )


if __name__ == "__main__":
    main()
