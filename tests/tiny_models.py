"""Tiny, random-weight model folders laid out the way Hugging Face ships them.

``make_tiny_llama(folder)`` writes config.json, generation_config.json,
model.safetensors (Hugging Face tensor names), tokenizer.json (a byte-level BPE
of ~300 entries trained here) and tokenizer_config.json with a ChatML template.
It needs numpy, safetensors and tokenizers only, so any test can reuse it.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text: every printable ASCII character (no control whitespace) appears, so any typed test
# message tokenizes; the merges come from ordinary English words. The alphabet is
# only what the corpus holds (not all 256 bytes), so a random model's output is
# readable characters rather than stray bytes.
CORPUS = [
    string.printable.strip() + " \n",
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun",
    "hello there how are you today I am fine thank you and you",
    "a model is a function that maps a prompt to a reply one token at a time",
    "write a story about a little robot who learns to paint the sea at night",
    "what is the capital of france paris is the capital and largest city",
    "def main(): print('hello world') return 0 if x > 1 else y + 2",
] * 4


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer with ChatML special tokens (ids 0..2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def make_tiny_llama(
    folder: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    vocab_size: int = 300,
) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    vocab = tok.get_vocab_size()
    tok.save(str(folder / "tokenizer.json"))
    eos_id = tok.token_to_id("<|im_end|>")

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "temperature": 0.7, "top_p": 0.9, "top_k": 40})
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 2048,
                "add_bos_token": False,
            },
            indent=2,
        )
    )

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": w(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": np.ones(hidden, np.float32),
                p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": w(intermediate, hidden),
                p + "mlp.up_proj.weight": w(intermediate, hidden),
                p + "mlp.down_proj.weight": w(hidden, intermediate),
            }
        )
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def make_tiny_adapter(
    folder: Path,
    *,
    seed: int = 1,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    rank: int = 4,
    scale: float = 4.0,
) -> Path:
    """An mlx-lm LoRA adapter folder (adapter_config.json + adapters.safetensors) for
    ``make_tiny_llama``'s model: random low-rank updates on q_proj and v_proj of every
    layer, strong enough to change what the model generates."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "fine_tune_type": "lora",
        "num_layers": layers,
        "lora_parameters": {
            "rank": rank,
            "scale": scale,
            "dropout": 0.0,
            "keys": ["self_attn.q_proj", "self_attn.v_proj"],
        },
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", heads * head_dim), ("v_proj", kv_heads * head_dim)):
            p = f"model.layers.{i}.self_attn.{proj}."
            tensors[p + "lora_a"] = (rng.standard_normal((hidden, rank)) * 0.5).astype(np.float32)
            tensors[p + "lora_b"] = (rng.standard_normal((rank, out)) * 0.5).astype(np.float32)
    save_file(tensors, str(folder / "adapters.safetensors"))
    return folder
