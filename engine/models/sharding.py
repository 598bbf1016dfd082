"""Splitting a family's model across the ranks of an ``mx.distributed`` group.

Two splits, both exact (the same operations on the same values as one process):

- **Pipeline**: rank r keeps a contiguous range of decoder layers (renumbered from 0 in
  its module tree), the embedding only on the first rank, the final norm and the head
  only on the last (the embedding too when the head is tied to it). Activations go rank
  to rank with ``send``/``recv``; every layer's cache lives on the rank that owns it.
- **Tensor**: every rank keeps every layer, with attention heads and feed-forward
  columns split by MLX's sharded linears (quantized ones included); a mixture of experts
  is split by expert, each rank computing its own experts' share of the routing and the
  shares combined with one all-reduce.

``make_sharded`` turns a built (not yet filled) family model into its sharded form in
place: its class becomes a subclass whose forward pass (1) agrees on a stop flag across
the ranks (rank 0 raises it; every rank sees it at the same step: a decode step reads it
from the previous step's summed logits, a prompt chunk sums it alone), (2) runs the local
part, (3) hands every rank the same logits (the last pipeline rank's, or rank 0's in
tensor mode), so the decode loop, sampling with the request's seed included, runs
unchanged and identically on every rank. Nothing here waits for anything the other
ranks do not also do: each rank builds the same graph of collectives.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import UnsupportedModelError
from engine.models.families import FAMILIES

LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def sharding_model_types(mode: str) -> list[str]:
    """The config model types that shard this way, as the family manifest declares them
    (``Family.shards``; Kimi K2 and Moonlight run as DeepSeek V3)."""
    return sorted(t for t, family in FAMILIES.items() if mode in family.shards and not t.endswith("_text"))


def check_family(model_type: str, mode: str) -> None:
    """Refuse, in one line naming those that do, a family that does not shard this way."""
    family = FAMILIES.get(model_type)
    if family is None or mode not in family.shards:
        raise UnsupportedModelError(
            f"{model_type} models do not shard ({mode}); --shard {mode} runs: {', '.join(sharding_model_types(mode))}"
        )


@dataclass
class ShardSpec:
    """Where this process sits: its group, the split, and (pipeline) its layer range."""

    group: Any  # mx.distributed.Group
    mode: str  # "pipeline" | "tensor"
    start: int = 0  # first global layer this rank holds (pipeline)
    end: int = 0  # one past its last
    dtype: Any = None  # activations' dtype (what a pipeline rank receives)
    hub_layout: bool | None = None  # the checkpoint's layout, for a sanitize that must know it
    # Stop agreed across ranks: ``requested`` is raised on rank 0 (a Stop), ``agreed`` is
    # what every rank's decode loop watches; it is set at the same step on all of them.
    requested: threading.Event = field(default_factory=threading.Event)
    agreed: threading.Event = field(default_factory=threading.Event)
    pending: Any = None  # the stop flag summed with the last one-token step's logits
    # On a rank 0 that serves (shard_leader.py): a forward pass the other ranks were not
    # told of (``mirrored``) would wait for them forever, so it raises instead.
    guarded: bool = False
    mirrored: bool = False

    def begin(self) -> None:
        """A new request on every rank: no stop agreed, none pending."""
        self.agreed.clear()
        self.pending = None

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def first(self) -> bool:
        return self.mode == "tensor" or self.rank == 0

    @property
    def last(self) -> bool:
        return self.mode == "tensor" or self.rank == self.size - 1

    @property
    def source(self) -> int:
        """The rank whose logits every rank uses."""
        return self.size - 1 if self.mode == "pipeline" else 0


# ---- which checkpoint tensors a rank keeps ---------------------------------------------------


def local_name(name: str, spec: ShardSpec) -> str | None:
    """The name a checkpoint tensor has in this rank's module tree, or None when the rank
    does not hold it. Layer tensors are renumbered from the rank's first layer."""
    if spec.mode == "tensor":
        return name
    m = LAYER_NAME.search(name)
    if m is None:
        return name  # the model decides below (``keep_modules``) whether it holds it
    i = int(m.group(1))
    if not spec.start <= i < spec.end:
        return None
    return name[: m.start(1)] + str(i - spec.start) + name[m.end(1) :]


def wanted(name: str, spec: ShardSpec) -> bool:
    """Whether a stored tensor (its checkpoint name) may belong to this rank: its layers, and
    whatever is not a layer (embedding, norm, head; the model keeps only its own)."""
    m = LAYER_NAME.search(name)
    return m is None or spec.mode == "tensor" or spec.start <= int(m.group(1)) < spec.end


def keep_held(weights: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """The weights whose module this rank's (trimmed) model still has."""
    from mlx.utils import tree_flatten

    names = {k for k, _ in tree_flatten(model.parameters())}
    modules = {k.rsplit(".", 1)[0] for k in names}
    return {k: v for k, v in weights.items() if k in names or k.rsplit(".", 1)[0] in modules}


# ---- pipeline -----------------------------------------------------------------------------


class _Link:
    """The last activation this rank sent (not a module attribute: never a parameter)."""

    sent: Any = None


class _Send(nn.Module):
    """Stands in for the final norm on a pipeline rank that is not the last: hands its
    layers' output to the next rank."""

    def __init__(self, spec: ShardSpec, link: _Link):
        super().__init__()
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_link", link)

    def __call__(self, h: mx.array) -> mx.array:
        spec = self._spec
        self._link.sent = mx.distributed.send(h, spec.rank + 1, group=spec.group)
        return self._link.sent


def _receiver(stack: nn.Module, spec: ShardSpec, hidden: int):
    def embed(inputs: mx.array) -> mx.array:
        like = mx.zeros((*inputs.shape, hidden), dtype=spec.dtype)
        return mx.distributed.recv_like(like, spec.rank - 1, group=spec.group)

    return embed


def split_pipeline(model: nn.Module, spec: ShardSpec) -> None:
    """Trim a built model to this rank's layers, embedding and head (before any weight is
    filled: what is dropped was never read)."""
    stack = model.model
    stack.layers = stack.layers[spec.start : spec.end]
    tied = bool(getattr(model.args, "tie_word_embeddings", False))
    link = _Link()
    object.__setattr__(model, "_link", link)
    if not spec.first:
        object.__setattr__(stack, "embed", _receiver(stack, spec, int(model.args.hidden_size)))
        if not (tied and spec.last):
            stack.pop("embed_tokens")
    if not spec.last:
        stack.norm = _Send(spec, link)
        if "lm_head" in model:
            model.pop("lm_head")


def _tie(cache: list, sent: mx.array) -> None:
    """Make evaluating the cache (all a prefill evaluates) perform the send too: the last
    layer's cache is made to depend on it (keys of a KV cache, the first state array of a
    recurrent one)."""
    c = cache[-1]
    if isinstance(getattr(c, "buffer", None), mx.array):  # keys and values in one buffer
        c.buffer = mx.depends(c.buffer, sent)
        return
    keys = getattr(c, "keys", None)
    if isinstance(keys, mx.array):
        c.keys = mx.depends(keys, sent)
        return
    if isinstance(keys, (tuple, list)) and keys and isinstance(keys[0], mx.array):  # quantized: codes, scales...
        c.keys = type(keys)([mx.depends(keys[0], sent), *keys[1:]])
        return
    arrays = getattr(c, "arrays", None)
    if isinstance(arrays, list) and arrays and isinstance(arrays[0], mx.array):
        arrays[0] = mx.depends(arrays[0], sent)
        return
    raise UnsupportedModelError(f"a {type(c).__name__} cannot carry a pipeline stage's output")


# ---- tensor -------------------------------------------------------------------------------


class _AllSum(nn.Module):
    """A block whose output each rank computes a share of, summed over the ranks."""

    def __init__(self, inner: nn.Module, group: Any):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_group", group)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.inner(x), group=self._group)


class LocalExperts(nn.Module):
    """A rank's slice of a stacked-expert MLP: routed tokens of other ranks' experts give 0."""

    def __init__(self, inner: nn.Module, start: int, count: int):
        super().__init__()
        self.inner = inner
        self.start, self.count = start, count

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        local = indices - self.start
        inside = (local >= 0) & (local < self.count)
        y = self.inner(x, mx.where(inside, local, 0))
        return y * inside[..., None].astype(y.dtype)


def _slice_experts(module: nn.Module, start: int, count: int) -> None:
    """Keep experts [start, start+count) of every stacked array (axis 0) under ``module``."""
    from mlx.utils import tree_map

    module.update(tree_map(lambda a: a[start : start + count] if isinstance(a, mx.array) else a, module.parameters()))


def _shard_dense_mlp(mlp: nn.Module, group: Any, reduce: bool) -> None:
    from mlx.nn.layers.distributed import shard_inplace, shard_linear

    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    if reduce:
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    else:  # its share only: summed with the experts' in the block's one all-reduce
        shard_inplace(mlp.down_proj, "sharded-to-all", group=group)


def _shard_attention(attn: nn.Module, group: Any) -> None:
    from mlx.nn.layers.distributed import shard_linear

    n = group.size()
    if attn.n_heads % n or attn.n_kv_heads % n:
        raise UnsupportedModelError(
            f"--shard tensor over {n} machines needs heads divisible by {n} "
            f"(this model has {attn.n_heads} query and {attn.n_kv_heads} key/value heads); use --shard pipeline"
        )
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= n
    attn.n_kv_heads //= n


def _shard_latent_attention(attn: nn.Module, group: Any) -> None:
    """Multi-head latent attention by heads: each rank its heads' query rows, their slices of
    the latent's per-head maps and of the output; the latent itself (one per token, shared
    by all heads) is computed and cached on every rank."""
    from mlx.nn.layers.distributed import shard_linear
    from mlx.utils import tree_map

    n, r = group.size(), group.rank()
    if attn.n_heads % n:
        raise UnsupportedModelError(
            f"--shard tensor over {n} machines needs heads divisible by {n} "
            f"(this model has {attn.n_heads}); use --shard pipeline"
        )
    each = attn.n_heads // n
    name = "q_proj" if "q_proj" in attn else "q_b_proj"
    setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    for per_head in (attn.embed_q, attn.unembed_out):
        per_head.update(tree_map(lambda a: a[r * each : (r + 1) * each], per_head.parameters()))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads = each


def _shard_moe(block: nn.Module, group: Any, n_experts: int) -> nn.Module:
    n, r = group.size(), group.rank()
    if n_experts % n:
        raise UnsupportedModelError(
            f"--shard tensor over {n} machines needs the {n_experts} experts divisible by {n}; use --shard pipeline"
        )
    count = n_experts // n
    _slice_experts(block.switch_mlp, r * count, count)
    block.switch_mlp = LocalExperts(block.switch_mlp, r * count, count)
    if "shared_experts" in block:
        _shard_dense_mlp(block.shared_experts, group, reduce=False)
    return _AllSum(block, group)


def split_tensor(model: nn.Module, spec: ShardSpec) -> None:
    """Split every layer's attention heads and feed-forward columns (experts by expert)."""
    group = spec.group
    for layer in model.model.layers:
        attn = layer.self_attn
        if "kv_a_proj_with_mqa" in attn:
            _shard_latent_attention(attn, group)
        else:
            _shard_attention(attn, group)
        mlp = layer.mlp
        if "switch_mlp" in mlp:
            experts = int(getattr(model.args, "num_experts", None) or model.args.n_routed_experts)
            layer.mlp = _shard_moe(mlp, group, experts)
        else:
            _shard_dense_mlp(mlp, group, reduce=True)


def compact(model: nn.Module) -> None:
    """Give every parameter its own buffer: a slice of a tensor read whole would otherwise
    keep the whole tensor alive (what a rank holds must be its share only)."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: mx.array(a) if isinstance(a, mx.array) else a, model.parameters()))


# ---- the forward pass every rank runs ------------------------------------------------------


class ShardedForward:
    """Mixed in ahead of the family's model class (``make_sharded``)."""

    _spec: ShardSpec
    _link: _Link

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None, **kwargs):
        spec = self._spec
        if input_embeddings is not None:
            raise UnsupportedModelError("a sharded model takes text only (no images, audio or video)")
        if spec.guarded and not spec.mirrored:
            raise UnsupportedModelError("this request does not run on a model split across machines yet")
        one_token = inputs.shape[-1] == 1
        if one_token and spec.pending is not None:
            # The flag rode with the previous step's logits, already (or about to be) read.
            if float(spec.pending.item()):
                spec.agreed.set()
        elif not one_token:
            agree_stop(spec)  # a prompt chunk: its logits may never be read
        out = super().__call__(inputs, cache, **kwargs)  # type: ignore[misc]
        if spec.rank != spec.source:
            # Every rank takes the source's logits; its own part rides along in the graph.
            out = mx.depends(mx.zeros(out.shape, out.dtype), out)
        if spec.mode == "pipeline" and not spec.last and cache is not None and self._link.sent is not None:
            _tie(cache, self._link.sent)
        if not one_token:
            spec.pending = None
            return mx.distributed.all_sum(out, group=spec.group)
        flag = mx.array([1 if spec.requested.is_set() else 0], dtype=out.dtype)
        packed = mx.distributed.all_sum(mx.concatenate([out.reshape(-1), flag]), group=spec.group)
        spec.pending = packed[-1]
        return packed[:-1].reshape(out.shape)

    def logits(self, h: mx.array) -> mx.array:
        spec = self._spec
        if spec.mode == "pipeline" and not spec.last:
            shape = (*h.shape[:-1], int(self.args.vocab_size))  # type: ignore[attr-defined]
            return mx.depends(mx.zeros(shape, spec.dtype), h)
        return super().logits(h)  # type: ignore[misc]


def agree_stop(spec: ShardSpec) -> None:
    """A small all-reduce of its own, for passes over several tokens (whose logits may
    never be read); one-token steps carry the flag with their logits. Either way a Stop
    raised on rank 0 reaches every rank at the same step."""
    flag = mx.array(1 if spec.requested.is_set() else 0, dtype=mx.int32)
    if int(mx.distributed.all_sum(flag, group=spec.group).item()):
        spec.agreed.set()


def make_sharded(model: nn.Module, spec: ShardSpec) -> nn.Module:
    """Split ``model`` (built, weights not yet filled) for this rank, in place."""
    check_family(str(model.model_type), spec.mode)
    if spec.mode == "pipeline":
        split_pipeline(model, spec)
    else:
        try:
            split_tensor(model, spec)
        except (ValueError, RuntimeError) as e:  # MLX's own refusal, e.g. a slice narrower than a group
            text = " ".join(str(e).split())[:200]
            raise UnsupportedModelError(
                f"--shard tensor over {spec.size} machines cannot split this model's layers evenly "
                f"(a quantization group or a dimension would be cut: {text}); use --shard pipeline"
            ) from None
    cls = type(model)
    model.__class__ = type(f"Sharded{cls.__name__}", (ShardedForward, cls), {})
    object.__setattr__(model, "_spec", spec)
    if not hasattr(model, "_link"):
        object.__setattr__(model, "_link", _Link())
    return model


def held_bytes(model: nn.Module) -> int:
    """Bytes of the arrays this rank's model actually holds (each distinct buffer once)."""
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(model.parameters()) if isinstance(a, mx.array))
