"""Loading one rank's share of a sharded model.

``load_share`` stands in for ``loading.load_model`` inside a rank (``use_shard``
installs it), so the host assembles tokenizer, template and the rest as for any load.
It opens only the safetensors files the index names for this rank's tensors (pipeline:
its layers, plus the embedding on the first rank and the head on the last; tensor: all
of them, keeping a 1/N slice of each); the other files are never opened, not even mapped.
The model is built, trimmed or split for the rank (engine.models.sharding) before a
weight is read, filled lazily, then evaluated layer by layer; what the rank holds is
then measured (``held_bytes``), not computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.artifacts.config import read_config, read_json
from engine.artifacts.hub import model_name, resolve_model_path
from engine.artifacts.weights import INDEX_NAME, find_weights, load_weights, read_headers
from engine.errors import UnsupportedModelError
from engine.models.checkpoint import cast_floats, fill_weights, quantize_like_checkpoint
from engine.models.sharding import ShardSpec, check_family, compact, held_bytes, keep_held, local_name, make_sharded
from engine.runtime import loading
from engine.runtime.loading import DTYPE_BYTES, LoadedModel, materialise

_HF_TO_MX = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float32"}


def role_wanted(name: str, spec: ShardSpec, tied: bool) -> bool:
    """Whether this rank needs a stored tensor, by its checkpoint name alone."""
    from engine.models.sharding import LAYER_NAME

    if spec.mode == "tensor":
        return True
    m = LAYER_NAME.search(name)
    if m is not None:
        return spec.start <= int(m.group(1)) < spec.end
    if "embed_tokens" in name:
        return spec.first or (tied and spec.last)
    return spec.last  # the head, the final norm (and what sanitize drops)


def share_files(folder: Path, spec: ShardSpec, tied: bool) -> list[Path]:
    """The files this rank must open: those the index lists for its tensors."""
    index = folder / INDEX_NAME
    if not index.is_file():
        return find_weights(folder)
    weight_map = read_json(index).get("weight_map") or {}
    names = sorted({f for n, f in weight_map.items() if role_wanted(n, spec, tied)})
    return [folder / n for n in names]


def _activation_dtype(headers: dict[str, Any]) -> str:
    for name, info in headers.items():
        if name.endswith("embed_tokens.weight") and info.dtype in _HF_TO_MX:
            return _HF_TO_MX[info.dtype]
    counts: dict[str, int] = {}
    for info in headers.values():
        if info.dtype in _HF_TO_MX:
            counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
    return _HF_TO_MX[max(counts, key=counts.__getitem__)] if counts else "bfloat16"


def load_share(
    path_or_repo: str | Path,
    spec: ShardSpec,
    *,
    memory_budget: int | None = None,
    dtype: str | None = None,
    progress: Any = None,
    **_: Any,
) -> LoadedModel:
    import mlx.core as mx

    from engine import models
    from engine.runtime.memory import default_budget, plan_memory

    path = resolve_model_path(path_or_repo)
    if path.is_file():
        raise UnsupportedModelError("a .gguf file does not shard: use the model's safetensors folder")
    config = read_config(path)
    check_family(config.model_type, spec.mode)
    family = models.get_family(config.model_type)
    args = family.ModelArgs.from_dict(config.raw)
    tied = bool(getattr(args, "tie_word_embeddings", False))
    files = share_files(path, spec, tied)
    headers = read_headers(files)
    stored = _activation_dtype(headers)
    act = dtype or stored
    spec.dtype = getattr(mx, act)

    model = family.Model(args)
    if spec.hub_layout is not None and hasattr(model, "hub_layout"):
        model.hub_layout = spec.hub_layout
    if spec.mode == "pipeline":
        make_sharded(model, spec)
    weights = {k: v for k, v in load_weights(files).items() if role_wanted(k, spec, tied)}
    if dtype is not None:
        weights = cast_floats(weights, dtype)
    weights = model.sanitize(weights)
    weights = {local_name(k, spec): v for k, v in weights.items()}
    weights = keep_held({k: v for k, v in weights.items() if k is not None}, model)
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    name = model_name(path)
    quantize_like_checkpoint(model, weights, config.quantization, name=name)
    if dtype is not None:
        weights = cast_floats(weights, dtype)
    fill_weights(model, weights, name=name)
    del weights
    if spec.mode == "tensor":
        make_sharded(model, spec)
        compact(model)
    if getattr(model, "mtp", None) is not None:
        del model.mtp
    materialise(model, progress)
    mx.clear_cache()
    model.eval()
    held = held_bytes(model)
    budget = memory_budget if memory_budget is not None else default_budget()[0]
    plan = plan_memory(config, budget=budget, weights_bytes=held, dtype_bytes=DTYPE_BYTES[act])
    return LoadedModel(
        model=model,
        config=config,
        path=path,
        name=name,
        weights_bytes=held,
        plan=plan,
        dtype=act,
        tokenizer_path=path,
    )


def use_shard(spec: ShardSpec | None) -> None:
    """Make every model load in this process load ``spec``'s share (None: whole models again)."""
    if spec is None:
        loading.share_loader = None
        return

    def load(path_or_repo: Any, **kw: Any) -> LoadedModel:
        return load_share(path_or_repo, spec, **kw)

    loading.share_loader = load
