"""Make the reference block logits the DFlash drafter tests compare against.

Needs torch and transformers (the tests do not). For a tiny random Qwen3 and a tiny random
Llama target it writes, under tests/golden/dflash/<name>/:

* target/: the transformers model (float32 safetensors, its config.json);
* drafter/: a tiny random DFlash drafter in the published layout (config.json with
  ``dflash_config``; ``layers.*``, ``fc``, ``hidden_norm``, ``norm`` weights);
* expected.json: the prompt, the target's greedy next token, and the drafter's logits for
  the block [that token, mask, ...] after the prompt.

The drafter's forward pass below is written from z-lab's published model code (dflash/
model.py: ``DFlashDraftModel.forward`` and ``Qwen3DFlashAttention``) on transformers' Qwen3
parts: target features are ``hidden_states[layer_id + 1]`` of the target's
``output_hidden_states`` concatenated in ``target_layer_ids`` order, projected by ``fc`` and
``hidden_norm``; keys/values are made from [context, block], queries from the block, RoPE at
the positions [0, prompt + block), no attention mask; logits are the target's ``lm_head``
over the drafter's normed output.

    python tests/golden/make_dflash_goldens.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

OUT = Path(__file__).resolve().parent / "dflash"
PROMPT = [5, 17, 3, 40, 22, 9, 31, 12, 5, 17]

TARGETS = {
    "qwen3": dict(model_type="qwen3", head_dim=10, rope_theta=20000.0, layer_ids=[0, 2]),
    "llama": dict(model_type="llama", rope_theta=30000.0, layer_ids=[1, 3]),  # 3 = the last: normed
}
DRAFTER = dict(
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    rms_norm_eps=1e-5,
    rope_theta=5000.0,
    block_size=6,
)


def make_target(name: str, spec: dict) -> torch.nn.Module:
    extra = {k: v for k, v in spec.items() if k not in ("model_type", "layer_ids", "rope_theta")}
    config = AutoConfig.for_model(
        spec["model_type"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def drafter_files(target: torch.nn.Module, layer_ids: list[int], seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = target.config
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "max_position_embeddings": 256,
        "attention_bias": False,
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_hidden_layers,
        "dflash_config": {"mask_token_id": cfg.vocab_size - 1, "target_layer_ids": layer_ids},
        "torch_dtype": "float32",
        **DRAFTER,
    }
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, DRAFTER["head_dim"]
    nq, nkv, ff = DRAFTER["num_attention_heads"], DRAFTER["num_key_value_heads"], DRAFTER["intermediate_size"]

    def w(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)

    def norm(n):
        return 1 + 0.3 * torch.randn(n, generator=g)

    weights = {"fc.weight": w(h, len(layer_ids) * h, scale=0.1), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(DRAFTER["num_hidden_layers"]):
        p = f"layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": w(nq * d, h),
                p + "self_attn.k_proj.weight": w(nkv * d, h),
                p + "self_attn.v_proj.weight": w(nkv * d, h),
                p + "self_attn.o_proj.weight": w(h, nq * d),
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "mlp.gate_proj.weight": w(ff, h),
                p + "mlp.up_proj.weight": w(ff, h),
                p + "mlp.down_proj.weight": w(h, ff),
                p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
            }
        )
    return config, {k: v.float().contiguous() for k, v in weights.items()}


def drafter_hidden(config: dict, weights: dict, target_hidden, noise, position_ids):
    """z-lab's DFlashDraftModel.forward (no cache, no mask: every query sees every key)."""
    qcfg = transformers.Qwen3Config(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
        max_position_embeddings=config["max_position_embeddings"],
    )
    eps, d = config["rms_norm_eps"], config["head_dim"]

    def rms(name, n, x):
        m = Qwen3RMSNorm(n, eps=eps)
        m.weight.data.copy_(weights[name])
        return m(x)

    def lin(name, x):
        return x @ weights[name].T

    ctx = rms("hidden_norm.weight", config["hidden_size"], lin("fc.weight", target_hidden))
    cos, sin = Qwen3RotaryEmbedding(qcfg)(noise, position_ids)
    h = noise
    b, q_len, _ = noise.shape
    c = ctx.shape[1]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(p + "input_layernorm.weight", config["hidden_size"], h)
        q = lin(p + "self_attn.q_proj.weight", x).view(b, q_len, -1, d)
        q = rms(p + "self_attn.q_norm.weight", d, q).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = lin(p + "self_attn.k_proj.weight", kv_in).view(b, c + q_len, -1, d)
        v = lin(p + "self_attn.v_proj.weight", kv_in).view(b, c + q_len, -1, d).transpose(1, 2)
        k = rms(p + "self_attn.k_norm.weight", d, k).transpose(1, 2)
        cq, sq = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cq[..., -q_len:, :] + rotate_half(q) * sq[..., -q_len:, :]
        k = k * cq + rotate_half(k) * sq
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=d**-0.5)
        h = h + lin(p + "self_attn.o_proj.weight", attn.transpose(1, 2).reshape(b, q_len, -1))
        mlp = Qwen3MLP(qcfg)
        mlp.gate_proj.weight.data.copy_(weights[p + "mlp.gate_proj.weight"])
        mlp.up_proj.weight.data.copy_(weights[p + "mlp.up_proj.weight"])
        mlp.down_proj.weight.data.copy_(weights[p + "mlp.down_proj.weight"])
        h = h + mlp(rms(p + "post_attention_layernorm.weight", config["hidden_size"], h))
    return rms("norm.weight", config["hidden_size"], h)


@torch.no_grad()
def make(name: str, spec: dict) -> None:
    target = make_target(name, spec)
    folder = OUT / name
    target.save_pretrained(folder / "target", safe_serialization=True)
    config, weights = drafter_files(target, spec["layer_ids"], seed=5)
    (folder / "drafter").mkdir(parents=True, exist_ok=True)
    (folder / "drafter" / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(folder / "drafter" / "model.safetensors"), metadata={"format": "pt"})

    ids = torch.tensor([PROMPT])
    out = target(ids, output_hidden_states=True)
    first = int(out.logits[0, -1].argmax())
    target_hidden = torch.cat([out.hidden_states[i + 1] for i in spec["layer_ids"]], dim=-1)
    block = torch.tensor([[first] + [config["dflash_config"]["mask_token_id"]] * (config["block_size"] - 1)])
    noise = target.model.embed_tokens(block)
    positions = torch.arange(len(PROMPT) + config["block_size"])[None]
    hidden = drafter_hidden(config, weights, target_hidden, noise, positions)
    logits = target.lm_head(hidden[:, 1:])[0]
    record = {
        "prompt": PROMPT,
        "first": first,
        "block_logits": np.round(logits.numpy().astype(np.float64), 6).tolist(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (folder / "expected.json").write_text(json.dumps(record))
    print(name, "first", first, "drafts", logits.argmax(-1).tolist())


if __name__ == "__main__":
    for name, spec in TARGETS.items():
        make(name, spec)
