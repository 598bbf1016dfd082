"""Writes a complete tiny model folder (config, safetensors, tokenizer, chat template)
the way Hugging Face lays one out, with random weights of a llama of hidden size 32, and
mlx-lm LoRA adapter folders that fit it."""

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


def _tokenizer(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def make_tiny_model_folder(
    path: Path,
    *,
    seed: int = 0,
    chat_template: str | None = CHATML,
    layers: int = 2,
    corpus: list[str] | None = None,
) -> Path:
    """``corpus`` trains the tokenizer (another corpus gives another vocabulary)."""
    from engine.models import get_family

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(corpus or CORPUS)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    bos, eos, im_end = tok.token_to_id("<s>"), tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
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


def make_tiny_adapter(
    path: Path, *, seed: int, layers: int = 2, rank: int = 4, scale: float = 2.0, fine_tune_type: str = "lora"
) -> Path:
    """An mlx-lm adapter folder for the model above: random LoRA on q_proj and v_proj of every
    layer, strong enough to change what the model generates."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "fine_tune_type": fine_tune_type,
        "num_layers": layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0},
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    key = mx.random.key(seed)
    weights = {}
    for i in range(layers):
        for proj, out in (("q_proj", 32), ("v_proj", 16)):  # 4 heads and 2 KV heads of 8
            key, ka, kb = mx.random.split(key, 3)
            weights[f"model.layers.{i}.self_attn.{proj}.lora_a"] = mx.random.normal((32, rank), key=ka) * 0.5
            weights[f"model.layers.{i}.self_attn.{proj}.lora_b"] = mx.random.normal((rank, out), key=kb) * 0.5
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    return path
