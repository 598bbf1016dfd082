"""Loading a model: folder, cached Hugging Face repo, or GGUF file -> a ready nn.Module.

Order matters: config and file headers are read and the memory plan is checked first,
so a model that cannot fit (or is truncated, or of an unknown family) is refused before
a byte of weights is read. Then the family's module tree is built, quantized exactly
as the checkpoint was, filled with ``load_weights(strict=True)``, and evaluated layer by
layer so a progress bar can follow and a cancel can land between layers.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.api import MemoryPlan
from engine.artifacts import gguf as gguf_io
from engine.artifacts.config import ModelConfig, config_from_dict, read_config
from engine.artifacts.hub import model_name, resolve_model_path
from engine.artifacts.mlx_quant import check_spec
from engine.artifacts.sanity import check_model_files
from engine.artifacts.sentence_transformers import EmbeddingSpec, read_embedding_spec
from engine.artifacts.weights import (
    FLOAT_DTYPES,
    INDEX_NAME,
    check_index,
    find_weights,
    load_weights,
    read_headers,
    weights_bytes,
)
from engine.decode.diffusion import DiffusionSettings, is_diffusion_model
from engine.errors import EngineError, ModelLoadError, UnsupportedModelError
from engine.files import SETTINGS_LIMIT, read_text_bounded
from engine.models.checkpoint import MX_DTYPE_NAMES, cast_floats, fill_weights, one_line, quantize_like_checkpoint
from engine.models.switch import MissingExperts
from engine.runtime.expert_plan import expert_layers, is_routed_expert

Progress = Callable[[int, int], None]

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}
_LAYER = re.compile(r"^(.*?layers\.\d+)\.")
READ_CHUNK_BYTES = 64 << 20  # the MTP layer's read reports progress after each run of about this
# Set inside a rank of a sharded model (engine.runtime.shard_load.use_shard): loads take that
# rank's share instead of the whole model.
share_loader: Callable[..., LoadedModel] | None = None


@dataclass
class LoadedModel:
    model: Any  # the family's nn.Module, weights evaluated
    config: ModelConfig
    path: Path  # the folder or .gguf file actually read
    name: str  # what to call it in messages and the UI
    weights_bytes: int
    plan: MemoryPlan
    dtype: str  # activation dtype: "bfloat16", "float16" or "float32"
    gguf_metadata: dict[str, Any] | None = None  # tokenizer and more, for GGUF files
    tokenizer_path: Path | None = None  # folder with tokenizer.json & co. (None for GGUF)
    embedding: EmbeddingSpec | None = None  # a sentence-transformers folder: the model embeds
    mtp_apart: MTPApart | None = None  # the built-in MTP layer, set apart unread (attach_mtp_apart)
    # What the load read of the files' config and headers: describing the model reuses it
    # (engine.runtime.model_info.inspect_model), so a load reads each header once.
    source: _Source | None = None


@dataclass
class MTPApart:
    """A built-in multi-token-prediction layer set apart at load, unread: its module (built
    and quantized as the checkpoint says) and its weights, lazy arrays over the files, so
    nothing is read or allocated until MTP drafting asks for it (``attach_mtp_apart``). A
    671B-class checkpoint's MTP layer is a whole MoE decoder layer, gigabytes."""

    head: Any
    weights: dict[str, Any] | None  # its parameter names (without "mtp.") -> lazy arrays; None: see unread
    nbytes: int  # what it holds once loaded (the memory plan's mtp_bytes)
    name: str  # the model's, for messages
    # The same weights afresh, lazy again. An array once evaluated keeps its data, so a read
    # given up half-way (``attach_mtp_apart`` cancelled) lets its weights go at once, and the
    # next read takes them anew from here (the files' headers and the family's sanitize, no
    # data: seconds at most on the largest checkpoints, paid by that read, not by the Stop).
    unread: Callable[[], dict[str, Any]]


@dataclass
class _Source:
    """What is known about a model before its weights load."""

    path: Path
    name: str
    config: ModelConfig
    weights_bytes: int
    dtype: str
    files: list[Path]
    weight_names: set[str]
    gguf: bool
    mtp_bytes: int = 0  # of weights_bytes: the built-in MTP layer (DeepSeek V3, GLM)
    left_out_bytes: int = 0  # stored but not loaded (further MTP layers, copies of embedding and head)
    headers: dict[str, Any] | None = None  # safetensors tensors by name (byte ranges for streamed experts)
    expert_bytes: int = 0  # of weights_bytes: the routed experts of the model's MoE layers
    expert_layers: int = 0  # MoE layers holding them
    gguf_header: Any = None  # a .gguf file's header as read


def load_model(
    path_or_repo: str | Path,
    *,
    memory_budget: int | None = None,
    dtype: str | None = None,
    progress: Progress | None = None,
    context_tokens: int = 0,
    mtp: bool = False,
    resident_experts: float | None = None,
    context_cap: int | None = None,
) -> LoadedModel:
    """Load a model, refusing before any weight is read when it does not fit the budget.

    ``dtype`` casts floating weights ("bfloat16", "float16", "float32"); by default they
    stay as stored. ``progress(done, total)`` is called as layers are materialised; it
    may raise to cancel the load, and the exception propagates unchanged. A built-in MTP
    layer loads only with ``mtp``; otherwise it is set apart unread (``mtp_apart``) and
    the plan's weights leave it out. An MoE model that does not fit, or is asked to keep
    only ``resident_experts`` of its experts, streams the rest from its files
    (engine.runtime.expert_plan), its slab sized beside the KV cache of ``context_cap``
    tokens (the longest context chats may reach) when one is given.
    """
    from engine import models
    from engine.runtime.expert_plan import family_streams_experts, plan_residency, start_streaming, stream_experts
    from engine.runtime.memory import check_fits, default_budget, plan_memory

    if share_loader is not None:
        return share_loader(path_or_repo, memory_budget=memory_budget, dtype=dtype, progress=progress)
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    source = inspect_source(path_or_repo, dtype=dtype)
    if (
        dtype is None
        and not source.gguf
        and not source.config.quantization
        and (source.path / "modules.json").is_file()
    ):
        # A sentence embedding model computes in float32, as sentence-transformers does by
        # default: vectors compared by cosine lose ~1e-4 to bfloat16, and these models are small.
        dtype = "float32"
        source = inspect_source(path_or_repo, dtype=dtype, read=source)  # recounted, not read again
    config = source.config
    if config.foreign_quantization:
        raise UnsupportedModelError(
            f"{source.name} is quantized with {config.foreign_quantization}, which MLX cannot run; "
            "use an MLX-quantized or unquantized version of the model"
        )
    family = models.get_family(config.model_type)
    args = family.ModelArgs.from_dict(config.raw)

    if memory_budget is None:
        budget, reason = default_budget()
    else:
        budget, reason = int(memory_budget), "set by --memory-budget"
    plan = plan_memory(
        config,
        budget=budget,
        weights_bytes=source.weights_bytes - (0 if mtp else source.mtp_bytes),
        dtype_bytes=DTYPE_BYTES[source.dtype],
        mtp_bytes=source.mtp_bytes,
        mtp_loaded=mtp,
        left_out_bytes=source.left_out_bytes,
    )
    if not source.gguf:
        plan = plan_residency(
            plan,
            source.expert_bytes,
            source.expert_layers,
            args,
            forced=resident_experts,
            context_tokens=max(context_tokens, context_cap or 0),
            model_context=config.context_length or 0,
            name=source.name,
            streams=family_streams_experts(config.model_type),
        )
    check_fits(plan, context_tokens=context_tokens, name=source.name, budget_reason=reason)

    gguf_metadata = None
    if source.gguf:
        config_dict, weights, gguf_metadata = gguf_io.load_gguf(source.path)
        config = config_from_dict(config_dict, path=source.path)
    else:
        weights = load_weights(source.files)

    embedding = None if source.gguf else read_embedding_spec(source.path, int(getattr(args, "hidden_size", 0)))
    if embedding is not None:
        from engine.models.embedder import Embedder

        model = Embedder(family, args, embedding)
    else:
        model = family.Model(args)
    store = None
    try:
        if dtype is not None:
            # Before sanitize too: what it computes (Qwen3.5's 1 + w norms) then rounds to the
            # chosen dtype, not to the stored one (a float32 load of a bf16 checkpoint).
            weights = cast_floats(weights, dtype)
        weights = _sanitize(model, weights, source)
        if embedding is not None:  # each Dense layer keeps its weights in its own folder
            for i, dense in enumerate(embedding.dense):
                weights.update({f"dense.{i}.{k}": v for k, v in load_weights(list(dense.files)).items()})
        quantize_like_checkpoint(model, weights, config.quantization, name=source.name)
        _check_complete(model, weights, source)
        if dtype is not None:
            weights = cast_floats(weights, dtype)
        apart = None if mtp else _set_mtp_apart(model, weights, source, args, dtype)
        if plan.experts is not None:  # before the fill: the stored experts are never read whole
            store = stream_experts(model, weights, source.headers or {}, plan.experts, source.name)
        fill_weights(model, weights, name=source.name)
        del weights
        materialise(model, progress)
        if store is not None:
            start_streaming(model, store, progress)
    except BaseException:
        if store is not None:
            store.close()
        _release()
        raise
    model.eval()
    if is_diffusion_model(model):  # its denoising settings are in generation_config.json
        model.diffusion_settings = _diffusion_settings(source.path)
    return LoadedModel(
        model=model,
        config=config,
        path=source.path,
        name=source.name,
        weights_bytes=plan.weights_bytes,
        plan=plan,
        dtype=source.dtype,
        gguf_metadata=gguf_metadata,
        tokenizer_path=None if source.gguf else source.path,
        embedding=embedding,
        mtp_apart=apart,
        source=source,
    )


def _set_mtp_apart(
    model: Any, weights: dict[str, Any], source: _Source, args: Any, dtype: str | None
) -> MTPApart | None:
    """Take the MTP layer the family's sanitize built (``model.mtp``, weights ``mtp.*``) off
    the model, its weights still unread."""
    if getattr(model, "mtp", None) is None:
        return None
    head = model.mtp
    del model.mtp
    taken = {k[len("mtp.") :]: weights.pop(k) for k in [k for k in weights if k.startswith("mtp.")]}
    return MTPApart(head, taken, source.mtp_bytes, source.name, lambda: _mtp_weights_afresh(source, args, dtype))


def _mtp_weights_afresh(source: _Source, args: Any, dtype: str | None) -> dict[str, Any]:
    """The MTP layer's weights as ``load_model`` set them apart, lazy over the files again:
    read, cast and sanitized alike. Sanitize runs on a scratch model (its parameters lazy,
    never allocated): the families build their MTP head on the model they sanitize for, and
    the loaded one must not get another."""
    from engine import models

    weights = load_weights(source.files)
    if dtype is not None:
        weights = cast_floats(weights, dtype)
    weights = _sanitize(models.get_family(source.config.model_type).Model(args), weights, source)
    if dtype is not None:
        weights = cast_floats(weights, dtype)
    return {k[len("mtp.") :]: v for k, v in weights.items() if k.startswith("mtp.")}


def attach_mtp_apart(
    model: Any, apart: MTPApart, progress: Progress | None = None, cancel: threading.Event | None = None
) -> bool:
    """Read the MTP layer set apart at load and put it on the model (``model.mtp``).
    ``progress(bytes read, bytes in all)`` follows the read, about ``READ_CHUNK_BYTES`` at a
    time: a large MoE checkpoint's layer is gigabytes, read while a request waits. ``cancel``
    is checked between those chunks; once set, the read stops and False is returned with the
    layer still apart and unread (what was read is let go), the model as it was."""
    if apart.weights is None:  # an earlier read was given up
        apart.weights = apart.unread()
    blank = apart.head.parameters()  # the head as built: lazy, nothing allocated
    fill_weights(apart.head, apart.weights, name=apart.name)
    try:
        read = materialise(apart.head, progress, chunk_bytes=READ_CHUNK_BYTES, cancel=cancel)
    except BaseException:
        _release()
        raise
    if not read:
        apart.head.update(blank)
        apart.weights = None
        _release()
        return False
    model.mtp = apart.head
    return True


def inspect_source(path_or_repo: str | Path, *, dtype: str | None = None, read: _Source | None = None) -> _Source:
    """Config, weight files and sizes of a model, from headers only. ``read``: what an
    earlier call read of the same files; its config and headers are counted again (for
    another ``dtype``) without reading them."""
    path = read.path if read is not None else resolve_model_path(path_or_repo)
    name = model_name(path)
    if path.is_file():
        header = read.gguf_header if read is not None else gguf_io.read_gguf_header(path)
        config = config_from_dict(gguf_io.gguf_config(header), path=path)
        gguf_io.check_readable(header)
        check_model_files(config, {n: t.shape for n, t in header.tensors.items()}, gguf=True)
        stored = _gguf_float_dtype(header)
        target = MX_DTYPE_NAMES.get(dtype or "", dtype) or stored
        size = sum(_gguf_loaded_bytes(t, target) for t in header.tensors.values())
        names = {n for n in header.tensors}
        return _Source(path, name, config, size, target, [path], names, gguf=True, gguf_header=header)

    if read is not None and read.headers is not None:
        config, files, headers = read.config, read.files, read.headers
    else:
        config = read_config(path)
        if config.quantization is not None:
            check_spec(config.quantization, where=name)
        files = find_weights(path)
        headers = read_headers(files)
        check_index(path, headers)
    check_model_files(
        config,
        {n: t.shape for n, t in headers.items()},
        packed=frozenset(n for n, t in headers.items() if t.dtype[:1] in "UI"),
    )
    stored = _stored_float_dtype(headers)
    target = MX_DTYPE_NAMES.get(dtype or "", dtype) or stored
    cast = DTYPE_BYTES[target] if dtype else None
    held = _resident(config, headers)
    size = weights_bytes({n: t for n, t in headers.items() if held(n)}, cast)
    mtp = weights_bytes({n: t for n, t in headers.items() if held(n) == "mtp"}, cast)
    widened = _widened_to_float32(config, headers, cast)  # routers held in float32
    size += sum(extra for n, extra in widened.items() if held(n))
    mtp += sum(extra for n, extra in widened.items() if held(n) == "mtp")
    source = _Source(path, name, config, size, target, files, set(headers), gguf=False)
    source.mtp_bytes, source.left_out_bytes = mtp, weights_bytes(headers, cast) - size
    experts = {n: t for n, t in headers.items() if held(n) == "model" and is_routed_expert(n)}
    source.headers, source.expert_bytes, source.expert_layers = (
        headers,
        weights_bytes(experts, cast),
        expert_layers(experts),
    )
    return source


def _resident(config: ModelConfig, headers: dict[str, Any]) -> Callable[[str], str | None]:
    """How each stored weight is held once loaded: the family's ``resident_weight`` (DeepSeek V3
    and GLM: "mtp" for the MTP layer, None for what is left out), else "model" for all."""
    from engine import models

    try:
        family = models.get_family(config.model_type)
    except EngineError:
        family = None
    rule = getattr(family, "resident_weight", None)
    n_layers = config.raw.get("num_hidden_layers")
    if rule is not None and not isinstance(n_layers, int):  # nested under text_config (Qwen3.5's published)
        try:
            n_layers = family.ModelArgs.from_dict(config.raw).num_hidden_layers
        except (EngineError, AttributeError, TypeError):
            n_layers = None
    if rule is None or not isinstance(n_layers, int):
        return lambda name: "model"
    return lambda name: rule(name, n_layers)


def _widened_to_float32(config: ModelConfig, headers: dict[str, Any], cast: int | None) -> dict[str, int]:
    """Bytes each float weight the family holds in float32 (its ``held_in_float32``: MoE
    routers) takes beyond what it would take as stored or cast."""
    from engine import models
    from engine.artifacts.weights import FLOAT_DTYPES

    try:
        rule = getattr(models.get_family(config.model_type), "held_in_float32", None)
    except EngineError:
        return {}
    if rule is None:
        return {}
    return {
        n: t.numel * 4 - (t.numel * cast if cast else t.nbytes)
        for n, t in headers.items()
        if t.dtype in FLOAT_DTYPES and rule(n)
    }


def _sanitize(model: Any, weights: dict[str, Any], source: _Source) -> dict[str, Any]:
    """The family's ``sanitize``; a tensor it needs that the files lack (one expert of a MoE
    layer, say) is named in one line rather than surfacing as a KeyError."""
    try:
        return model.sanitize(weights)
    except KeyError as e:
        raise ModelLoadError(f"{source.name} lacks {e.args[0]}{_where_missing(source)}") from None
    except MissingExperts as e:
        raise ModelLoadError(f"{source.name} {e.args[0]}{_where_missing(source)}") from None


def _check_complete(model: Any, weights: dict[str, Any], source: _Source) -> None:
    """Name the first tensor the model needs and no file holds (an unlisted expert shard)."""
    from mlx.utils import tree_flatten

    missing = sorted({k for k, _ in tree_flatten(model.parameters())} - set(weights))
    if missing:
        more = f" and {len(missing) - 1} more tensor(s)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{source.name} lacks {missing[0]}{more}{_where_missing(source)}")


def _where_missing(source: _Source) -> str:
    if not source.gguf and (source.path / INDEX_NAME).is_file():
        return f"; no shard listed in {INDEX_NAME} holds it: download the model (with its index) again"
    return "; the weight files are incomplete: download the model again"


def materialise(
    model: Any, progress: Progress | None, chunk_bytes: int | None = None, cancel: threading.Event | None = None
) -> bool:
    """Evaluate the parameters one layer at a time, reporting progress between layers; with
    ``chunk_bytes``, in runs of parameters of about that many bytes, progress in bytes.
    False when ``cancel`` was set before a layer or run (those before it are evaluated)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    groups: dict[str | int, list[Any]] = {}
    run = held = 0
    for key, value in tree_flatten(model.parameters()):
        if chunk_bytes is None:
            m = _LAYER.match(key)
            group: str | int = m.group(1) if m else key.rsplit(".", 1)[0]
        else:  # consecutive runs of about chunk_bytes
            if held >= chunk_bytes:
                run, held = run + 1, 0
            group, held = run, held + value.nbytes
        groups.setdefault(group, []).append(value)
    sizes = [sum(a.nbytes for a in arrays) if chunk_bytes else 1 for arrays in groups.values()]
    total, done = sum(sizes), 0
    if progress is not None:
        progress(0, total)
    for size, arrays in zip(sizes, groups.values()):
        if cancel is not None and cancel.is_set():
            return False
        try:
            mx.eval(arrays)
        except Exception as e:  # a file that changed or vanished since its header was read
            raise ModelLoadError(f"reading weights failed: {one_line(e)}; download the model again") from None
        done += size
        if progress is not None:
            progress(done, total)
    return True


def _release() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # nothing to free is fine
        pass


def _stored_float_dtype(headers: dict[str, Any]) -> str:
    """The dtype activations will run in: that of the (unquantized) embedding, or the
    most common float dtype (quantized checkpoints: their scales')."""
    for name, info in headers.items():
        if name.endswith("embed_tokens.weight") and info.dtype in FLOAT_DTYPES:
            return _HF_TO_MX[info.dtype]
    counts: dict[str, int] = {}
    for info in headers.values():
        if info.dtype in FLOAT_DTYPES:
            counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
    if not counts:
        return "bfloat16"
    return _HF_TO_MX[max(counts, key=counts.__getitem__)]


_HF_TO_MX = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float32"}


def _gguf_float_dtype(header: gguf_io.GGUFHeader) -> str:
    embed = header.tensors.get("token_embd.weight")
    kind = embed.type_name if embed else "F32"
    return {"F16": "float16", "BF16": "bfloat16"}.get(kind, "float32" if kind == "F32" else "float16")


def _gguf_loaded_bytes(tensor: gguf_io.GGUFTensor, dtype: str) -> int:
    """Bytes a GGUF tensor takes once MLX holds it (quantized ones as packed + scales + biases)."""
    n = tensor.numel
    if tensor.type_name in ("Q4_0", "Q4_1"):
        return n // 2 + n // 32 * 4
    if tensor.type_name == "Q8_0":
        return n + n // 32 * 4
    return n * DTYPE_BYTES[dtype] if tensor.type_name in ("F32", "F16", "BF16") else tensor.nbytes


def _diffusion_settings(path: Any) -> DiffusionSettings:
    file = Path(path) / "generation_config.json"
    try:
        generation = json.loads(read_text_bounded(file, SETTINGS_LIMIT, "a model's settings")) if file.is_file() else {}
    except (OSError, ValueError) as exc:
        raise EngineError(f"{file} is not readable JSON: {exc}") from exc
    return DiffusionSettings.from_generation_config(generation if isinstance(generation, dict) else {})
