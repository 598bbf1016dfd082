"""Writes a complete tiny model folder (config, safetensors, tokenizer, chat template)
the way Hugging Face lays one out, with random weights of a llama of hidden size 32."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Once upon a time there was a little robot who liked to count the stars.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "user assistant system hello how are you today? I am fine, thanks.",
] * 4


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_tiny_model_folder(path: Path, *, seed: int = 0, chat_template: str | None = CHATML) -> Path:
    from engine.models import get_family

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    bos, eos, im_end = tok.token_to_id("<s>"), tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": bos, "eos_token_id": eos,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, im_end], "bos_token_id": bos}))
    tok_config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))

    family = get_family("llama")
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    # Larger than default init so greedy output is not one token repeated.
    weights = {k: v * 3.0 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path
