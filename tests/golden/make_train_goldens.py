"""Make the references the training tests compare against (needs torch, transformers, peft).

Writes tests/golden/training/:

- model/: a tiny random Llama (float32, the published config spelling mlx-lm reads too),
  with a small byte-level BPE tokenizer and a ChatML template (tests/tiny_models.py's);
- init_adapter/: a PEFT LoRA adapter (r 4, alpha 8, q_proj and v_proj of both blocks,
  random A and B, so both get gradients from the first step) the training starts from;
- train.jsonl: text rows;
- expected.json: PEFT's losses for plain SGD over batches of consecutive rows in file
  order (each loss the mean cross-entropy over the batch's predicted tokens, padding
  excluded, computed before the step's update), then PEFT's greedy ids for a prompt with
  the trained adapter (and the base model's, which must differ).

    /path/to/python tests/golden/make_train_goldens.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import peft
import torch
import transformers

HERE = Path(__file__).resolve().parent
OUT = HERE / "training"
sys.path.insert(0, str(HERE.parent))
from tiny_models import CHATML_TEMPLATE, make_tokenizer  # noqa: E402

ROWS = [
    "the quick brown fox jumps over the lazy dog",
    "hello there how are you today",
    "a model is a function that maps a prompt to a reply",
    "write a story about a little robot",
    "what is the capital of france paris is the capital",
    "the cat sleeps in the sun while the dog runs",
]
LR = 0.05
ITERS = 4
BATCH = 2
PROMPT = "the quick brown"
NEW_TOKENS = 8


def build_model(vocab: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def write_model(model, tok) -> Path:
    folder = OUT / "model"
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = 10000.0  # the published spelling, which mlx-lm reads as well
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1) + "\n")
    return folder


def batch_loss(model, rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])[:, 1:]
    logits = model(input_ids=ids).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    return (ce * mask.reshape(-1)).sum() / mask.sum()


def greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    tok = make_tokenizer(300)
    eos = tok.token_to_id("<|im_end|>")
    model = build_model(tok.get_vocab_size())
    write_model(model, tok)
    (OUT / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ROWS))
    rows = [tok.encode(t).ids + [eos] for t in ROWS]
    prompt = tok.encode(PROMPT).ids
    base_greedy = greedy(model, prompt)

    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights=False)  # fmt: skip
    tuned = peft.get_peft_model(model, lora)
    tuned.save_pretrained(OUT / "init_adapter", safe_serialization=True)
    (OUT / "init_adapter" / "README.md").unlink(missing_ok=True)  # a model-card stub
    optimizer = torch.optim.SGD([p for p in tuned.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(ITERS):
        batch = [rows[(step * BATCH + j) % len(rows)] for j in range(BATCH)]
        optimizer.zero_grad()
        loss = batch_loss(tuned, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
    tuned.eval()
    tuned_greedy = greedy(tuned, prompt)
    assert tuned_greedy != base_greedy, "the trained adapter should change the greedy continuation"
    expected = {
        "lr": LR, "iters": ITERS, "batch_size": BATCH, "rank": 4, "layers": 2, "keys": "q_proj,v_proj",
        "train_losses": losses, "prompt_ids": prompt, "greedy_ids": tuned_greedy, "base_greedy_ids": base_greedy,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }  # fmt: skip
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps(expected))


if __name__ == "__main__":
    main()
