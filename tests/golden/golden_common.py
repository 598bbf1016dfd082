"""What the golden scripts share once a tiny random transformers model exists: looking for
a seed whose greedy continuation is clear of near-ties, checking that transformers' cached
and uncached decoding agree, and writing the folder a test reads (bf16 weights, the
config.json, expected.json with the versions that made it).

The model-building and greedy-decoding recipe itself is make_model_goldens.py's
(``build``, ``reference``); the scripts import both from there and this from here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    """Ids 3.. (clear of pad, bos and eos) from a fixed generator."""
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def clear_greedy(generated: list[int], margins: list[float]) -> bool:
    """Refuse near-ties (a 1e-5 difference in float32 could flip such a greedy pick) and
    continuations stuck on a few tokens (they would exercise little)."""
    return min(margins) > 5e-3 and len(set(generated)) >= 5


def search_seed(
    name: str,
    make_model: Callable[[int], Any],
    reference: Callable[[Any, list[int]], tuple[list[int], list[float], list[float]]],
    prompt_len: int,
    *,
    seeds: int = 100,
    prompt_seed: int = 1000,
    vocab: int | None = None,
    accept: Callable[[int, Any, list[int], list[int], list[float]], bool] | None = None,
) -> tuple[Any, int, list[int], list[int], list[float], list[float]]:
    """(model, seed, prompt, greedy ids, log-probs, top-2 margins) for the first seed whose
    ``make_model(seed)`` decodes clearly (and that ``accept(seed, model, prompt, ids,
    log-probs)`` takes, where given); the prompt for seed s comes from ``prompt_seed + s``."""
    for seed in range(seeds):
        model = make_model(seed)
        size = vocab or model.config.get_text_config().vocab_size
        prompt = random_prompt(size, prompt_len, prompt_seed + seed)
        generated, logprobs, margins = reference(model, prompt)
        if clear_greedy(generated, margins) and (accept is None or accept(seed, model, prompt, generated, logprobs)):
            return model, seed, prompt, generated, logprobs, margins
    raise SystemExit(f"{name}: no seed gave clear greedy margins")


def uncached_greedy(model, prompt: list[int], generated: list[int]) -> list[int]:
    """Greedy picks from one forward pass over prompt + continuation, without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated]), use_cache=False).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def fresh_folder(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def pretrained_files(model) -> tuple[dict, Path]:
    """The model saved by transformers in bf16 into a new temporary folder: its config.json
    as a dict, and the folder (the caller copies what it keeps, then removes it)."""
    tmp = tempfile.mkdtemp()
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    return json.loads((Path(tmp) / "config.json").read_text()), Path(tmp)


def save_checkpoint(model, folder: Path) -> dict:
    """A fresh ``folder`` holding the model's weights in bf16 as transformers writes them;
    returns its config.json as a dict (for the caller to respell and write)."""
    fresh_folder(folder)
    config, tmp = pretrained_files(model)
    try:
        shutil.copy(tmp / "model.safetensors", folder / "model.safetensors")
    finally:
        shutil.rmtree(tmp)
    return config


def write_json(path: Path, data: dict, sort_keys: bool = False) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")


def write_config(folder: Path, config: dict) -> None:
    """config.json with float32 as its dtype: the reference ran in float32 on the bf16 values."""
    config["torch_dtype"] = "float32"
    write_json(folder / "config.json", config, sort_keys=True)


def greedy_record(
    seed: int, prompt: list[int], generated: list[int], logprobs: list[float], margins: list[float], **extra: Any
) -> dict:
    """expected.json's usual fields: who made it, the seed, the prompt and the reference."""
    return {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "seed": seed,
        "prompt_ids": prompt,
        "greedy_ids": generated,
        "logprobs": logprobs,
        "min_top2_margin": min(margins),
        **extra,
    }


def folder_kb(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) // 1024


# ---- multimodal folders (a processor beside the weights) -------------------------------


def bpe_tokenizer(specials: list[str], corpus: list[str], vocab_size: int = 240):
    """A small byte-level BPE trained on ``corpus``, ``specials`` first (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def fast_tokenizer(tok, **special: Any) -> transformers.PreTrainedTokenizerFast:
    """transformers' tokenizer over a ``tokenizers`` one (through a temporary tokenizer.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(str(Path(tmp) / "tokenizer.json"))
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(tmp) / "tokenizer.json"), **special)


def saved_and_reloaded(model, cls, folder: Path):
    """Save ``model`` into a fresh ``folder`` in bf16 and read it back in float32: the
    references run on exactly the values on disk (casting in place would also round the
    rotary inv_freq buffers). generation_config.json is left out: the tests do not read it."""
    if folder.exists():
        shutil.rmtree(folder)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


def template_in_tokenizer_config(folder: Path, template: str, **settings: Any) -> None:
    """The chat template where the engine reads it first (tokenizer_config.json), not in a
    separate chat_template.jinja; ``settings`` go into the same file."""
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = template
    tok_cfg.update(settings)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def media_greedy(model, inputs, new_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy ids over processor ``inputs`` with each chosen token's log-prob
    and the top-2 margins, after checking that uncached generation picks the same ids."""
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        plain = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, use_cache=False, pad_token_id=0)
    ids = out.sequences[0, n:].tolist()
    if plain[0, n:].tolist() != ids:
        raise SystemExit("transformers' cached and uncached greedy disagree")
    lps, margins = [], []
    for logits, t in zip(out.logits, ids):
        lp = torch.log_softmax(logits[0].float(), -1)
        top = torch.topk(lp, 2).values
        lps.append(lp[t].item())
        margins.append((top[0] - top[1]).item())
    return ids, lps, margins


def digest(a) -> dict:
    """A float32 array (or tensor) in a few bytes: sha256 of its bytes, float64 sum, shape."""
    import hashlib

    import numpy as np

    x = a.detach().float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float32)
    x = np.ascontiguousarray(x)
    return {
        "sha256": hashlib.sha256(x.tobytes()).hexdigest(),
        "sum": float(x.astype(np.float64).sum()),
        "shape": list(x.shape),
    }
