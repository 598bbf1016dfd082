"""Make the references the decision-scoring tests compare against (needs torch + transformers).

For tiny golden checkpoints already in tests/golden (dense Llama, sliding-window Mistral
and Gemma 2, MoE Qwen3, and Qwen2.5-VL with ../shared/data/images/chelsea.png), it runs
transformers once over prompt + candidate for each candidate, without a cache, and
records the candidate's log-probability: the sum over its tokens of log-softmax of the
logits one position earlier. Candidates are token ids of several lengths, some sharing
first tokens, the longest crossing the sliding windows. Written to tests/golden/decide/expected.json.

    /path/to/python tests/golden/make_decide_goldens.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from PIL import Image

HERE = Path(__file__).resolve().parent
OUT = HERE / "decide" / "expected.json"
IMAGE = HERE.parents[1].parent / "shared" / "data" / "images" / "chelsea.png"

CANDIDATES = [[5], [17, 33], [17, 90], [100, 200, 7, 9], [42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [3, 3, 3]]
# Clear of the vision model's special ids (image pad, vision start/end), which are all below 10.
VL_CANDIDATES = [[t + 20 for t in c] for c in CANDIDATES]
TEXT_FAMILIES = ["llama", "mistral", "gemma2", "qwen3_moe"]


def candidate_logprob(logits: torch.Tensor, start: int, candidate: list[int]) -> float:
    lp = torch.log_softmax(logits.double(), dim=-1)
    return float(sum(lp[start - 1 + j, t] for j, t in enumerate(candidate)))


def text_family(name: str) -> dict:
    folder = HERE / "models" / name
    expected = json.loads((folder / "expected.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = expected["prompt_ids"]
    scores = []
    for cand in CANDIDATES:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + cand]), use_cache=False).logits[0]
        scores.append(candidate_logprob(logits, len(prompt), cand))
    return {"prompt_ids": prompt, "candidates": CANDIDATES, "logprobs": scores}


def qwen2_5_vl() -> dict:
    folder = HERE / "vision" / "qwen2_5_vl"
    expected = json.loads((folder / "expected.json").read_text())
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    config = model.config
    proc = transformers.Qwen2VLImageProcessorPil(min_pixels=pre["min_pixels"], max_pixels=pre["max_pixels"])
    vision = proc([Image.open(IMAGE).convert("RGB")], return_tensors="pt")
    prompt = expected["prompt_ids"]
    scores = []
    for cand in VL_CANDIDATES:
        ids = torch.tensor([prompt + cand])
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                pixel_values=vision["pixel_values"],
                image_grid_thw=vision["image_grid_thw"],
                mm_token_type_ids=(ids == config.image_token_id).int(),
                use_cache=False,
            ).logits[0]
        scores.append(candidate_logprob(logits, len(prompt), cand))
    return {"image": IMAGE.name, "messages": expected["messages"], "candidates": VL_CANDIDATES, "logprobs": scores}


def main() -> None:
    out = {name: text_family(name) for name in TEXT_FAMILIES}
    out["qwen2_5_vl"] = qwen2_5_vl()
    out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    for name, record in out.items():
        if name != "versions":
            print(name, [round(x, 4) for x in record["logprobs"]])


if __name__ == "__main__":
    main()
