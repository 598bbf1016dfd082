"""Make the reference files for the LoRA/DoRA adapter tests.

Runs with torch, transformers and peft installed (the tests need none of them):

    python tests/golden/make_adapter_goldens.py

Writes tests/golden/adapters/:
  base/                 config.json + model.safetensors of a tiny random LlamaForCausalLM (float32)
  peft_qv/              PEFT LoRA on q_proj+v_proj, rsLoRA scaling (alpha / sqrt(r))
  peft_vo_mlp/          PEFT LoRA on v_proj, o_proj, up_proj, down_proj with rank_pattern and
                        alpha_pattern (per-module rank and alpha)
  peft_dora_kg/         PEFT DoRA on k_proj, v_proj, gate_proj (trained-looking magnitudes)
  mlxlm_qv/, mlxlm_dora_kg/  the same weights as peft_qv / peft_dora_kg, written in mlx-lm's
                        format (a = A.T, b = B.T, scale = PEFT's scaling, m = magnitude)
  logits.safetensors    logits [L, vocab] for PROMPT under each adapter combination (see CASES)

PEFT initialises lora_B to zero (a no-op adapter), so every LoRA matrix is overwritten with random
values here. "Both" means PEFT's `set_adapter([first, second])`: PEFT adds the active adapters'
outputs in list order, and a DoRA adapter rescales the running result it is handed (base output
plus any earlier adapter's delta). So a DoRA adapter listed first sees the plain base output,
which is the combination rule the engine uses for every adapter; the script checks that the
reverse order differs, so the recorded case is the one that is meant.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).resolve().parent / "adapters"
PROMPT = [1, 7, 42, 99, 3, 64, 127, 15, 8, 77]

ADAPTERS = {
    "qv": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    "vo_mlp": LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["v_proj", "o_proj", "up_proj", "down_proj"],
        rank_pattern={"o_proj": 2},
        alpha_pattern={"down_proj": 32},
        lora_dropout=0.0,
    ),
    "dora_kg": LoraConfig(
        r=4,
        lora_alpha=4,
        use_dora=True,
        target_modules=["k_proj", "v_proj", "gate_proj"],
        lora_dropout=0.0,
    ),
}

# name -> (active adapters in PEFT's order, scale multiplier applied to every active adapter)
CASES = {
    "none": ([], 1.0),
    "qv": (["qv"], 1.0),
    "vo_mlp": (["vo_mlp"], 1.0),
    "dora_kg": (["dora_kg"], 1.0),
    "qv+vo_mlp": (["qv", "vo_mlp"], 1.0),
    "dora_kg+qv": (["dora_kg", "qv"], 1.0),
    "qv@0.5": (["qv"], 0.5),
}


def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def set_multiplier(model, names, mult):
    for layer in lora_layers(model):
        for name in names:
            layer.set_scale(name, mult)


def logits_for(model, names, mult):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        if not names:
            with model.disable_adapter():
                return model(ids).logits[0].clone()
        model.base_model.set_adapter(names)
        set_multiplier(model, names, mult)
        out = model(ids).logits[0].clone()
        set_multiplier(model, names, 1.0)
        return out


def to_mlxlm(peft_dir: Path, out_dir: Path, cfg: LoraConfig, kind: str, scale: float) -> None:
    weights = load_file(peft_dir / "adapter_model.safetensors")
    converted = {}
    for key, value in weights.items():
        path = key.removeprefix("base_model.model.")
        if path.endswith(".lora_A.weight"):
            converted[path.removesuffix(".lora_A.weight") + ".lora_a"] = value.T.contiguous()
        elif path.endswith(".lora_B.weight"):
            converted[path.removesuffix(".lora_B.weight") + ".lora_b"] = value.T.contiguous()
        elif ".lora_magnitude_vector" in path:
            converted[path.split(".lora_magnitude_vector")[0] + ".m"] = value.contiguous()
        else:
            raise SystemExit(f"unexpected PEFT key {key}")
    out_dir.mkdir(parents=True)
    # Stored under another name; the tests lay it out as mlx-lm's adapters.safetensors.
    save_file(converted, out_dir / "weights.safetensors")
    config = {
        "fine_tune_type": kind,
        "num_layers": 2,
        "lora_parameters": {
            "rank": cfg.r,
            "scale": scale,
            "dropout": 0.0,
            "keys": sorted(
                f"self_attn.{t}" if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else f"mlp.{t}"
                for t in cfg.target_modules
            ),
        },
        "model": "tiny-random-llama",
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    base = LlamaForCausalLM(config).eval()
    # Default init is small; widen it so logits spread and adapter effects are well above noise.
    with torch.no_grad():
        for p in base.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    base.save_pretrained(OUT / "base", safe_serialization=True)

    names = list(ADAPTERS)
    model = get_peft_model(base, ADAPTERS[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, ADAPTERS[name])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".lora_A." in pname or ".lora_B." in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
            elif ".lora_magnitude_vector." in pname:
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    model.eval()

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, selected_adapters=names)
        for name in names:
            src = Path(tmp) / name if (Path(tmp) / name).is_dir() else Path(tmp)
            dst = OUT / f"peft_{name}"
            dst.mkdir()
            for fname in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy(src / fname, dst / fname)

    to_mlxlm(OUT / "peft_qv", OUT / "mlxlm_qv", ADAPTERS["qv"], "lora", 8 / 2.0)
    to_mlxlm(OUT / "peft_dora_kg", OUT / "mlxlm_dora_kg", ADAPTERS["dora_kg"], "dora", 1.0)

    logits = {case: logits_for(model, act, mult) for case, (act, mult) in CASES.items()}
    for case in CASES:
        if case != "none":
            diff = (logits[case] - logits["none"]).abs().max().item()
            assert diff > 1e-2, f"{case} barely changes the logits ({diff})"
    reverse = logits_for(model, ["qv", "dora_kg"], 1.0)
    gap = (reverse - logits["dora_kg+qv"]).abs().max().item()
    assert gap > 1e-4, "PEFT order no longer matters for DoRA; revisit the combination rule"
    save_file({k: v.contiguous() for k, v in logits.items()}, OUT / "logits.safetensors")
    (OUT / "prompt.json").write_text(json.dumps({"prompt": PROMPT, "cases": CASES}, indent=1))
    print(f"wrote {OUT}; DoRA order gap {gap:.3g}")


if __name__ == "__main__":
    main()
