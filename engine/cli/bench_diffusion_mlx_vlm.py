"""mlx-vlm's DiffusionGemma as the speed referee of ``bench --vs mlx-vlm``: its model class
holding exactly our random weights, and its own block-diffusion generator timed on them.

mlx-vlm nests the shared layers under ``model.decoder.``, keeps the encoder's per-layer
scales apart, and fuses each expert's gate and up projections into one ``gate_up_proj``
(quantized weights, scales and biases alike, along the output axis). Its generator is
run with transformers' entropy-bound sampler over whole canvases, never stopping a block
early and never stopping at an end-of-sequence id, as ours is here.
"""

from __future__ import annotations

import time
from typing import Any

from engine.errors import EngineError

_EXPERTS = ".experts.switch_glu."


def _twin_names(ours: list[tuple[str, Any]]) -> dict[str, Any]:
    import mlx.core as mx

    out: dict[str, Any] = {}
    fused: dict[str, dict[str, Any]] = {}
    for name, value in ours:
        if name == "encoder_layer_scalars":
            for i in range(value.shape[0]):
                out[f"model.encoder.language_model.layers.{i}.layer_scalar"] = value[i : i + 1]
        elif _EXPERTS in name:
            layer, rest = name.split(_EXPERTS)
            proj, part = rest.split(".", 1)  # gate_proj / up_proj / down_proj, then weight / scales / biases
            twin_layer = "model.decoder." + layer.removeprefix("model.")
            if proj == "down_proj":
                out[f"{twin_layer}.experts.down_proj.{part}"] = value
            else:
                fused.setdefault(f"{twin_layer}.experts.gate_up_proj.{part}", {})[proj] = value
        elif name.startswith("self_conditioning."):
            out["model.decoder." + name] = value
        else:
            out["model.decoder." + name.removeprefix("model.")] = value
    for name, halves in fused.items():
        out[name] = mx.concatenate([halves["gate_proj"], halves["up_proj"]], axis=1)
    return out


def _twin_module(path: str) -> str:
    """Our quantized module's path as mlx-vlm names it."""
    if _EXPERTS in path:
        layer, proj = path.split(_EXPERTS)
        proj = "gate_up_proj" if proj in ("gate_proj", "up_proj") else proj
        return "model.decoder." + layer.removeprefix("model.") + ".experts." + proj
    if path.startswith("self_conditioning."):
        return "model.decoder." + path
    return "model.decoder." + path.removeprefix("model.")


def mlx_vlm_twin(model: Any, config: dict[str, Any], quantized: set[str], steps: int) -> Any:
    try:
        from mlx_vlm.models.diffusion_gemma import Model, ModelConfig
    except ImportError:
        raise EngineError("--vs mlx-vlm needs mlx-vlm: pip install mlx-vlm") from None
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    skip = ("model_type", "canvas_length", "quantization")
    text = {k: v for k, v in config.items() if k not in skip} | {"model_type": "diffusion_gemma_text"}
    twin_config = ModelConfig.from_dict(
        {"model_type": "diffusion_gemma", "canvas_length": config["canvas_length"], "text_config": text}
    )
    twin_config.vision_config = None
    # transformers' sampler and schedule; a block never stops early (nothing is below 0).
    twin_config.generation_config = {
        "max_denoising_steps": steps,
        "t_min": 0.4,
        "t_max": 0.8,
        "confidence_threshold": 0.0,
        "stability_threshold": 1,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    }
    twin = Model(twin_config)
    twin.set_dtype(mx.bfloat16)
    if quantized:
        q = config["quantization"]
        targets = {_twin_module(p) for p in quantized}
        nn.quantize(
            twin,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=lambda p, m: p in targets,
        )
    try:
        twin.load_weights(list(_twin_names(tree_flatten(model.parameters())).items()), strict=True)
    except ValueError as e:
        raise EngineError(f"mlx-vlm's diffusion_gemma does not take our weights: {e}") from None
    mx.eval(twin.parameters())
    return twin


class _NoText:
    """What mlx-vlm's generator asks of a tokenizer: nothing stops it, no text is kept."""

    last_segment = ""

    @property
    def detokenizer(self) -> _NoText:
        return self

    def reset(self) -> None:
        pass

    def add_token(self, token: int, **_: Any) -> None:
        pass

    def finalize(self) -> None:
        pass

    def stopping_criteria(self, token: int) -> bool:
        return False


def time_mlx_vlm(twin: Any, prompt: Any, gen: int, steps: int, seed: int) -> dict[str, Any]:
    """One timed run: the fields of engine.cli.bench_diffusion.DiffusionTiming."""
    import mlx.core as mx
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    mx.random.seed(seed)
    mx.clear_cache()
    mx.reset_peak_memory()
    shim = _NoText()
    start = time.perf_counter()
    first = None
    last = None
    blocks = 0
    for result in stream_diffusion_generate(
        twin,
        shim,
        shim,
        prompt[None].astype(mx.int32),
        None,
        None,
        max_tokens=gen,
        skip_special_token_ids=[],
        max_denoising_steps=steps,
        diffusion_full_canvas=True,
        diffusion_sampler="entropy-bound",
    ):
        if result.diffusion_block_complete:
            blocks += 1
            first = first or time.perf_counter()
        last = result
    end = time.perf_counter()
    assert last is not None
    prompt_s = last.prompt_tokens / max(last.prompt_tps, 1e-9)
    generation_s = max(end - start - prompt_s, 1e-9)
    taken = int(last.diffusion_denoising_steps)
    return dict(
        prompt_tokens=int(last.prompt_tokens),
        generated_tokens=int(last.generation_tokens),
        blocks=blocks,
        denoising_steps=taken,
        prompt_tps=float(last.prompt_tps),
        generation_tps=last.generation_tokens / generation_s,
        step_ms=1000 * generation_s / max(taken, 1),
        ttft_s=(first or end) - start,
        peak_memory_bytes=int(mx.get_peak_memory()),
    )
