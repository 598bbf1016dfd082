"""Make the DiffusionGemma reference outputs (tests/golden/diffusion_gemma/<name>/).

Needs torch + transformers 5.23; the tests do not. Each variant is a tiny random
``DiffusionGemmaForBlockDiffusion`` (Gemma 4's MoE layers, shared by a causal prompt
encoder and a bidirectional canvas decoder with self-conditioning), saved in bfloat16.

Two references per folder (``reference.safetensors`` + ``diffusion.json``):

* the logits of two decoder passes over a fixed noised canvas after the prompt: the
  first without self-conditioning, the second conditioned on the first's logits;
* transformers' own ``generate`` (block diffusion: entropy-bound acceptance, linear
  temperature schedule, stable-and-confident early stop), with every random draw it
  made recorded: the uniform canvases (``torch.randint``) and the categorical samples
  (``torch.multinomial``), in order. Fed the same draws, an implementation of the same
  algorithm must produce the same ids and take the same number of steps per block.

Two config spellings, as for Gemma 4: transformers 5.23's ``per_layer_config`` table,
and the published repos' ``global_head_dim`` / ``num_global_key_value_heads``.

    python tests/golden/make_diffusion_gemma_goldens.py [name ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from golden_common import save_checkpoint, write_config
from make_gemma4_goldens import VISION, published
from safetensors.torch import save_file
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen_module

OUT = Path(__file__).resolve().parent / "diffusion_gemma"

TEXT = dict(
    hidden_size=64,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    sliding_window=6,  # shorter than the prompt and than prompt + canvas
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    final_logit_softcapping=30.0,
    use_bidirectional_attention="vision",
    rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 200000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
)
CANVAS = 8
PROMPT_LEN = 11
# Generation settings, each off transformers' default (steps 48, bound 0.1, t 0.4..0.8,
# stability 1, confidence 0.005) so a mix-up of any of them shows.
GENERATION = dict(
    max_new_tokens=4 * CANVAS,
    max_denoising_steps=10,
    t_min=0.3,
    t_max=0.9,
    stability_threshold=2,
    confidence_threshold=0.5,
    entropy_bound=2.5,
)

MARGIN = 2e-3  # no decision of the reference closer than this to flipping
SHARPEN, EOS_BOOST = 30.0, 1.4

# name -> (published spelling?, generation settings). A random network's argmax follows
# its noisy canvas, so it never holds still for two steps: the stability history is run
# (and must never fire) with the published spelling, and left out (threshold 0, so
# confidence alone stops a block) in the other, where blocks then stop early.
VARIANTS = {
    "diffusion_gemma_tiny": (False, dict(GENERATION, stability_threshold=0)),
    "diffusion_gemma_published": (True, GENERATION),
}


def build(seed: int, vision: dict = VISION, image_ids: tuple[int, int, int] = (250, 251, 252)):
    """A random model; ``image_ids``: the image, begin-image and end-image token ids."""
    torch.manual_seed(seed)
    config = DiffusionGemmaConfig(
        text_config=dict(TEXT),
        vision_config=vision,
        canvas_length=CANVAS,
        image_token_id=image_ids[0],
        boi_token_id=image_ids[1],
        eoi_token_id=image_ids[2],
    )
    model = DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms, router scales: make a (1 + w) vs w mix-up show
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
            if name.endswith("embed_tokens.weight"):
                p.mul_(0.2)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        # Sharpen the decoder's predictions (a random model's are near uniform, which would
        # accept one token per step and never stop early), and make the end-of-sequence id
        # likely enough to show up within a few blocks.
        model.model.decoder.norm.weight.mul_(SHARPEN)
        # A random network fed its own sharp predictions is chaotic (float32 rounding grew
        # tenfold per step); a quieter self-conditioning output keeps it stable.
        model.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
        model.model.decoder.embed_tokens.weight[TEXT["eos_token_id"]].mul_(EOS_BOOST)
        for p in (
            model.model.decoder.norm.weight,
            model.model.decoder.embed_tokens.weight,
            model.model.decoder.self_conditioning.down_proj.weight,
        ):
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # encoder and decoder layers each store their own
                b.copy_(torch.empty_like(b).uniform_(0.6, 1.4).to(torch.bfloat16).to(torch.float32))
    model.eval()
    return model


class Recorder:
    """Wraps torch.randint / torch.multinomial while generate runs, keeping what they return."""

    def __init__(self):
        self.canvases: list[list[int]] = []
        self.samples: list[list[int]] = []
        self.order: list[str] = []  # "c" canvas, "s" sample
        self._randint, self._multinomial = torch.randint, torch.multinomial
        self._accept = gen_module.EntropyBoundSampler.accept_canvas
        self._stop = gen_module.StableAndConfidentStoppingCriteria.__call__
        self.margins: list[float] = []

    def __enter__(self):
        def randint(*args, **kwargs):
            out = self._randint(*args, **kwargs)
            self.canvases.append(out[0].tolist())
            self.order.append("c")
            return out

        def multinomial(probs, *args, **kwargs):
            out = self._multinomial(probs, *args, **kwargs)
            self.samples.append(out[:, 0].tolist())
            self.order.append("s")
            return out

        def accept(sampler, current, denoiser, logits, step):
            # How close each decision came to flipping: the entropy bound's cut, and the
            # argmax's top-2 gap (a float32 implementation differs in the last bits).
            entropy = torch.distributions.Categorical(logits=logits).entropy()[0]
            ranked = torch.sort(entropy).values
            self.margins.append(float((torch.cumsum(ranked, 0) - ranked - sampler.entropy_bound).abs().min()))
            top2 = torch.topk(logits[0], 2, dim=-1).values
            self.margins.append(float((top2[:, 0] - top2[:, 1]).min()))
            return self._accept(sampler, current, denoiser, logits, step)

        def stop(criteria, argmax, logits, **kwargs):
            entropy = torch.distributions.Categorical(logits=logits).entropy().mean()
            self.margins.append(float((entropy - criteria.confidence_threshold).abs()))
            return self._stop(criteria, argmax, logits, **kwargs)

        torch.randint, torch.multinomial = randint, multinomial
        gen_module.EntropyBoundSampler.accept_canvas = accept
        gen_module.StableAndConfidentStoppingCriteria.__call__ = stop
        return self

    def __exit__(self, *exc):
        torch.randint, torch.multinomial = self._randint, self._multinomial
        gen_module.EntropyBoundSampler.accept_canvas = self._accept
        gen_module.StableAndConfidentStoppingCriteria.__call__ = self._stop


def generate(model, prompt: list[int], settings: dict, **inputs) -> dict:
    settings = dict(settings)
    bound = settings.pop("entropy_bound")
    config = gen_module.DiffusionGemmaGenerationConfig(
        **settings,
        sampler_config=gen_module.EntropyBoundSamplerConfig(entropy_bound=bound),
        eos_token_id=TEXT["eos_token_id"],
        pad_token_id=TEXT["pad_token_id"],
    )
    torch.manual_seed(0)
    with Recorder() as rec, torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config, **inputs)
    # Each block draws one starting canvas, then per step one categorical sample and one
    # renoise canvas: a draw of a canvas right after another canvas starts a new block.
    steps_per_block: list[int] = []
    previous = None
    for kind in rec.order:
        if kind == "s":
            steps_per_block[-1] += 1
        elif previous != "s":
            steps_per_block.append(0)
        previous = kind
    return {
        "sequences": out.sequences[0].tolist(),
        "canvases": rec.canvases,
        "samples": rec.samples,
        "tokens_per_forward": float(out.tokens_per_forward[0]),
        "steps_per_block": steps_per_block,
        "min_margin": min(rec.margins),
    }


def forward_reference(model, prompt: list[int]) -> tuple[dict, list[int]]:
    """Logits of two decoder passes over a fixed canvas (the second self-conditioned)."""
    gen = torch.Generator().manual_seed(7)
    canvas = torch.randint(0, TEXT["vocab_size"], (1, CANVAS), generator=gen)
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config.get_text_config(decoder=True))
        first = model(input_ids=torch.tensor([prompt]), past_key_values=cache, decoder_input_ids=canvas).logits
        second = model(past_key_values=cache, decoder_input_ids=canvas, self_conditioning_logits=first).logits
        # The cache must be read-only to the decoder: a second pass without self-conditioning repeats the first.
        again = model(past_key_values=cache, decoder_input_ids=canvas).logits
    assert torch.equal(again, first), "the decoder changed the prompt cache"
    return {"first_logits": first[0].contiguous(), "second_logits": second[0].contiguous()}, canvas[0].tolist()


def make(name: str) -> None:
    spelled_published, settings = VARIANTS[name]
    seed = 0
    model = build(seed)
    # A prompt under which the reference shows everything: a block that stops early, one
    # that runs every step, several tokens accepted in one step, and an end-of-sequence
    # id inside a later block.
    for attempt in range(400):
        gen = torch.Generator().manual_seed(1000 + attempt)
        prompt = torch.randint(3, 250, (PROMPT_LEN,), generator=gen).tolist()
        trial = generate(model, prompt, settings)
        steps = trial["steps_per_block"]
        new = trial["sequences"][PROMPT_LEN:]
        ends = [i for i, t in enumerate(new) if t == TEXT["eos_token_id"]]
        print(attempt, steps, ends, trial["min_margin"])
        if trial["min_margin"] < MARGIN:
            continue
        most = settings["max_denoising_steps"]
        if settings["stability_threshold"] == 0:  # some block stops early, some runs a while
            paths = min(steps) < most and max(steps) >= 3
        else:
            paths = min(steps) == most
        if len(steps) >= 2 and paths and ends and ends[0] >= CANVAS:
            break
    else:
        raise SystemExit(f"{name}: no prompt showed every path")

    folder = OUT / name
    config = save_checkpoint(model, folder)
    if spelled_published:
        config = published(config)
    write_config(folder, config)

    # The references come from what transformers reads back from the files as written.
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    tensors, canvas = forward_reference(model, prompt)
    save_file(tensors, str(folder / "reference.safetensors"))
    result = generate(model, prompt, settings)
    expected = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "spelling": "published (global_head_dim)" if spelled_published else "transformers 5 (per_layer_config)",
        "prompt_ids": prompt,
        "forward_canvas": canvas,
        "generation": settings,
        **result,
    }
    (folder / "diffusion.json").write_text(json.dumps(expected) + "\n")
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(
        f"{name}: {size // 1024} KB, {len(result['canvases'])} canvases, {len(result['samples'])} steps, "
        f"ids {result['sequences'][PROMPT_LEN:]}"
    )


if __name__ == "__main__":
    for name in sys.argv[1:] or VARIANTS:
        make(name)
