"""``python -m engine bench --step``: one decode step taken apart, ours next to mlx-lm's.

The plain bench says which loop decodes faster; this says where a step's time goes.
After a ``-p`` token prompt is in both caches, it times ``-g`` decode steps, pipelined as
the decode loops run them (step n+1 is queued before token n is read), for

* ``engine compiled``: our compiled step (engine/decode/compiled_step.py), also for
  models whose decoding takes the plain pass by default (latent attention),
* ``engine plain``: our model's forward pass (with the projections stacked),
* ``mlx-lm``: mlx-lm's model's forward pass on the same weights (``--vs mlx-lm``),

with the host's share of each step (building its graph, handing it to the device), its
op count (the primitives in its graph that do work, views left out: close to the kernels
a GPU launches), and, for the compiled step, the time its traced layer functions take
apart from what runs outside them (cache writes and attention).
Then the parts of one layer (its attention, and for mixture-of-experts layers the
router, the routed and the shared experts), each timed alone on both models, times how
many layers have it: where the two steps differ, one of these rows says so.

``--rows N`` takes the batch step apart the same way: N streams decoding together after the
same prompt (the continuous batch's step, ``CompiledDecoder.rows``, over one batch cache per
layer; mlx-lm's model over its own batch caches), each part fed N rows. A step reads the
weights once whatever its rows, so an N-row step should cost little more than a one-row
step; where it costs more, this says which part.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from engine.errors import EngineError

# Primitives that make views (no kernel of their own on contiguous inputs).
_VIEWS = frozenset(
    {"Reshape", "Slice", "Broadcast", "ExpandDims", "Squeeze", "Transpose", "Unflatten", "Flatten", "Split"}
    | {"StopGradient", "AsStrided", "Depends"}
)


# Prompts go in in chunks of this many tokens, as the plain bench's loops take them.
PREFILL_CHUNK = 2048


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step",
        action="store_true",
        help="take one decode step apart: ours (compiled and plain) next to mlx-lm's, part by part",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=1,
        metavar="N",
        help="with --step: the batch step of N streams after the same prompt (continuous batching)",
    )


def add_mla_attention_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mla-attention",
        choices=["fused", "composed"],
        help="latent-attention models: MLX's fused attention call, or the few-kernel composed "
        "form (default: composed except on Metal)",
    )


def apply_mla_attention(args: argparse.Namespace) -> None:
    choice = getattr(args, "mla_attention", None)
    if choice is not None:
        from engine.models import mla

        mla.COMPOSE = choice == "composed"


def graph_nodes(outputs: Any) -> dict[str, int]:
    """Every primitive in the graph that computes ``outputs`` (not yet evaluated), views
    included, by name: what MLX builds again each time a traced function is called, so what a
    step's build time follows."""
    import mlx.core as mx

    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, outputs)
        with open(path) as f:
            labels = re.findall(r'\[label ?= ?"([^"]*)", shape=rectangle\]', f.read())
    finally:
        os.unlink(path)
    return dict(collections.Counter(labels))


def without_views(nodes: dict[str, int]) -> dict[str, int]:
    """``graph_nodes``' count without the views: the primitives that do work (close to the
    kernels a GPU launches)."""
    return {name: n for name, n in nodes.items() if name not in _VIEWS}


class _Prompted:
    """A model's cache holding the prompt (``cache``, a list kept as the same object), put
    back there after use: trimmed where every layer's cache can be, else filled again
    (sliding-window caches that have wrapped around cannot be trimmed)."""

    def __init__(self, model: Any, make: Callable[[], list[Any]], prompt: Any):
        self.model, self.make, self.prompt = model, make, prompt
        self.cache: list[Any] = []
        self.fill()

    def fill(self) -> None:
        import mlx.core as mx

        self.cache[:] = self.make()
        for start in range(0, int(self.prompt.size), PREFILL_CHUNK):
            self.model(self.prompt[None, start : start + PREFILL_CHUNK], cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def trimmable(self) -> bool:
        return all(getattr(c, "is_trimmable", lambda: True)() for c in self.cache)

    def rewind(self) -> None:
        if self.trimmable():
            self.trim()
        else:
            self.fill()

    def trim(self) -> None:
        """Back to the prompt where trimming can; else left as it is (a ring buffer stays
        the same size, so what runs on it costs the same)."""
        if self.trimmable():
            for c in self.cache:
                c.trim(c.offset - int(self.prompt.size))


class _Rows:
    """``rows`` copies of a prompted cache as one batch cache per layer (``batch`` makes it
    from the layer caches and the row count): the same interface as ``_Prompted``, each
    layer trimmed back to the prompt after use, so its buffer stays grown and a step writes
    in place as a running batch's does."""

    def __init__(self, single: _Prompted, rows: int, batch: Callable[[list[Any], int], list[Any]]):
        import mlx.core as mx

        self.cache = batch(single.cache, rows)
        mx.eval([c.state for c in self.cache])
        self.columns = [_columns(c) for c in self.cache]

    def trim(self) -> None:
        for c, columns in zip(self.cache, self.columns):
            c.trim(_columns(c) - columns)

    rewind = trim


def _columns(cache: Any) -> int:
    """Columns a batch cache holds: ours (``idx``) or mlx-lm's (``_idx``)."""
    return int(cache.idx if hasattr(cache, "idx") else cache._idx)


def _our_batch(caches: list[Any], rows: int) -> list[Any]:
    """The engine's batch caches holding ``rows`` copies of each layer's prompt."""
    from engine.decode.batch_cache import BatchKVCache

    out = []
    for c in caches:
        batch = BatchKVCache()
        keys, values = c.state
        for _ in range(rows):
            batch.add(keys, values)
        out.append(batch)
    return out


def _their_batch(caches: list[Any], rows: int) -> list[Any]:
    """mlx-lm's batch caches (its ``KVCache.merge``) holding ``rows`` copies of each prompt."""
    return [c.merge([c] * rows) for c in caches]


def time_steps(forward: Callable[[Any], Any], first: Any, n: int) -> tuple[dict[str, float], list[Any]]:
    """Seconds per step over ``n`` greedy steps fed back into ``forward`` (tokens [rows] ->
    logits [rows, vocab]), queued one ahead as the decode loops do, and the tokens. Besides
    the step (``step``), the host's share of it: building its graph (``build``) and
    handing it to the device (``launch``, what ``async_eval`` takes); when their sum is
    close to the step, the step waits on the host, not on the device."""
    import mlx.core as mx

    build = launch = 0.0

    def step(tok):
        nonlocal build, launch
        start = time.perf_counter()
        y = mx.argmax(forward(tok), axis=-1)
        mid = time.perf_counter()
        mx.async_eval(y)
        build, launch = build + mid - start, launch + time.perf_counter() - mid
        return y

    y = step(first)
    build = launch = 0.0
    tokens = []
    start = time.perf_counter()
    for i in range(n):
        nxt = step(y) if i + 1 < n else None
        tokens.append(y.tolist())
        y = nxt
    total = time.perf_counter() - start
    return {"step": total / n, "build": build / max(n - 1, 1), "launch": launch / max(n - 1, 1)}, tokens


def time_calls(fn: Callable[[], Any], n: int, after: Callable[[], None] = lambda: None) -> float:
    """Seconds per call of ``fn``, each evaluated before the next (``after`` undoes what
    a call left in a cache); the best of three rounds."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
        after()
    best = float("inf")
    for _ in range(3):
        total = 0.0
        for _ in range(n):
            start = time.perf_counter()
            mx.eval(fn())
            total += time.perf_counter() - start
            after()
        best = min(best, total / n)
    return best


class _Split:
    """The compiled step run piece by piece: the traced layer functions timed apart from
    the cache writes and attention between them."""

    def __init__(self, decoder: Any, layers: list[Any]):
        self.decoder, self.layers = decoder, layers

    def __call__(self, tokens: Any, cache: list[Any], rows: int = 1) -> tuple[float, float]:
        import mlx.core as mx

        from engine.models.base import cached_attention_kv

        fns = self.decoder._fns
        if rows > 1:  # a batch step: one position per row, one mask for all layers
            pos, h, last = cache[0].offset, tokens[:, None], self.decoder._last_rows
            masks = [cache[0].make_mask(1)] * len(cache)
        else:
            pos, h, last = mx.array(cache[0].offset, dtype=mx.int32), tokens[None], fns[-1]
            masks = self.decoder.masks(cache, int(tokens.shape[0]))
        traced = outside = 0.0
        attn = None
        for i, (layer, c, mask) in enumerate(zip(self.layers, cache, masks or [None] * len(cache))):
            start = time.perf_counter()
            h, q, kv = fns[0](h, pos) if i == 0 else fns[i](h, attn, pos)
            mx.eval(h, q, kv)
            mid = time.perf_counter()
            attn = cached_attention_kv(layer.self_attn, q, kv, c, mask)
            mx.eval(attn)
            traced, outside = traced + mid - start, outside + time.perf_counter() - mid
        start = time.perf_counter()
        mx.eval(last(h, attn))
        return traced + time.perf_counter() - start, outside


def _layer_parts(
    ours: Any, theirs: Any | None, x: Any
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]:
    """One layer's parts, each a call on both models with the same input."""
    import mlx.core as mx

    parts: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {}
    mlp, their_mlp = ours.mlp, (theirs.mlp if theirs is not None else None)
    if "gate" in mlp and "switch_mlp" in mlp:
        chosen, _ = mlp.gate(x)
        mx.eval(chosen)
        parts["router"] = (lambda: mlp.gate(x), (lambda: their_mlp.gate(x)) if their_mlp is not None else None)
        parts["routed experts"] = (
            lambda: mlp.switch_mlp(x, chosen),
            (lambda: their_mlp.switch_mlp(x, chosen)) if their_mlp is not None else None,
        )
        if "shared_experts" in mlp:
            shared = their_mlp.shared_experts if their_mlp is not None and "shared_experts" in their_mlp else None
            parts["shared experts"] = (
                lambda: mlp.shared_experts(x),
                (lambda: shared(x)) if shared is not None else None,
            )
        parts["moe block"] = (lambda: mlp(x), (lambda: their_mlp(x)) if their_mlp is not None else None)
    else:
        parts["dense mlp"] = (lambda: mlp(x), (lambda: their_mlp(x)) if their_mlp is not None else None)
    return parts


def run_step(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from engine.cli.bench import SHAPES, build_model, mlx_lm_twin
    from engine.decode.compiled_step import compiled_decoder
    from engine.models.kv_cache import make_prompt_cache

    if args.shape not in SHAPES:
        raise EngineError(f"--step takes a text shape ({', '.join(sorted(SHAPES))}), not {args.shape}")
    if args.prompt_tokens < 1 or args.generation_tokens < 2:
        raise EngineError("bench --step needs -p >= 1 and -g >= 2")
    if args.vs == "mlx-lm":
        import importlib.util

        if importlib.util.find_spec("mlx_lm") is None:
            raise EngineError("--vs mlx-lm needs mlx-lm installed: pip install 'mlx-desk[bench]' (or mlx-lm)")
    if args.mode != "affine":
        from engine.artifacts.mlx_quant import MODES

        args.bits, args.group_size = MODES[args.mode].default
    if args.rows < 1:
        raise EngineError(f"--rows must be 1 or more, not {args.rows}")
    model, config, quantized = build_model(args.shape, args.bits, args.group_size, args.seed, args.mode)
    if args.rows > 1:
        from engine.decode.batch import batchable

        if not batchable(model):
            raise EngineError(f"--rows: {args.shape}'s streams decode one at a time; pick a Llama or Qwen shape")
    twin = mlx_lm_twin(model, config, quantized) if args.vs == "mlx-lm" else None
    # Layers that decode through the plain pass by default (``compiled_decode = False``,
    # latent attention) take the compiled step here anyway, so the two can be compared.
    for layer in model.layers:
        if not getattr(getattr(layer, "self_attn", None), "compiled_decode", True):
            layer.self_attn.compiled_decode = True
    decoder = compiled_decoder(model)
    if decoder is not None and not decoder.prepare():
        decoder = None
    p, g = args.prompt_tokens, args.generation_tokens
    prompt = mx.random.randint(0, config["vocab_size"], (p,), key=mx.random.key(args.seed)).astype(mx.uint32)

    ours = _Prompted(model, lambda: make_prompt_cache(model), prompt)
    theirs = None
    if twin is not None:
        from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

        theirs = _Prompted(twin, lambda: mlx_lm_cache(twin), prompt)
    if decoder is not None and decoder.masks(ours.cache, 1) is None:
        print("(the compiled step does not take this model's caches: plain passes only)", flush=True)
        decoder = None
    rows = args.rows
    what = "one decode step" if rows == 1 else f"one batch step of {rows} rows"
    print(
        f"{args.shape} ({args.bits}-bit g{args.group_size}, random weights) on {mx.default_device()}: "
        f"{what} after a {p}-token prompt, {g} steps per run, {args.repeat} run(s)",
        flush=True,
    )

    ours, theirs, first, loops = _step_loops(model, twin, decoder, ours, theirs, prompt[-1:], rows)
    decoder = decoder if "engine compiled" in loops else None

    steps: dict[str, dict[str, Any]] = {}
    ids: dict[str, list[int]] = {}  # each loop's greedy tokens: the loops must agree
    for name, (forward, prompted) in loops.items():
        graph = forward(first)
        nodes = graph_nodes(graph)
        ops = without_views(nodes)
        mx.eval(graph)
        prompted.rewind()
        time_steps(forward, first, 2)  # warm-up (traces, kernels)
        prompted.rewind()
        runs, tokens = [], []
        for _ in range(max(1, args.repeat)):
            times, tokens = time_steps(forward, first, g)
            runs.append(times)
            prompted.rewind()
        best = min(runs, key=lambda t: t["step"])
        steps[name] = {
            "ms": 1000 * best["step"],
            "median_ms": 1000 * statistics.median(t["step"] for t in runs),
            "build_ms": 1000 * best["build"],
            "launch_ms": 1000 * best["launch"],
            "ops": sum(ops.values()),
            "nodes": sum(nodes.values()),
        }
        steps[name]["op_kinds"] = ops
        steps[name]["view_kinds"] = {kind: n for kind, n in nodes.items() if kind not in ops}
        ids[name] = tokens
    for name, s in steps.items():
        print(
            f"{name:<16} {s['ms']:8.3f} ms/step (median {s['median_ms']:8.3f}; host: build {s['build_ms']:.3f}, "
            f"launch {s['launch_ms']:.3f})   {s['ops']:5d} ops/step",
            flush=True,
        )
    for name, s in steps.items():
        most = sorted(s["op_kinds"].items(), key=lambda kv: -kv[1])[:6]
        print(
            f"  {name}: {s['nodes']} graph nodes with views; most ops: " + ", ".join(f"{kind} {n}" for kind, n in most),
            flush=True,
        )

    out: dict[str, Any] = {"shape": args.shape, "prompt_tokens": p, "rows": rows, "steps": steps}
    if decoder is not None:
        split = _Split(decoder, list(model.layers))
        times = []
        for _ in range(3):
            times.append(split(first, ours.cache, rows))
            ours.rewind()
        traced, outside = zip(*times)
        out["compiled_split_ms"] = {"traced": 1000 * min(traced), "outside": 1000 * min(outside)}
        print(
            f"compiled step, synced per layer: traced functions {out['compiled_split_ms']['traced']:.3f} ms, "
            f"cache writes + attention outside them {out['compiled_split_ms']['outside']:.3f} ms",
            flush=True,
        )

    out["parts_ms"] = part_rows(model, twin, ours, theirs, max(8, g // 4), rows)
    if "engine compiled" in ids:
        out["compiled_matches_plain"] = ids["engine compiled"] == ids["engine plain"]
    if "mlx-lm" in ids:
        out["same_tokens_as_mlx_lm"] = ids["engine plain"] == ids["mlx-lm"]
    if args.json:
        print(json.dumps(out))
    return 0


def _step_loops(
    model: Any, twin: Any | None, decoder: Any | None, ours: _Prompted, theirs: _Prompted | None, first: Any, rows: int
) -> tuple[Any, Any, Any, dict[str, tuple[Callable[[Any], Any], Any]]]:
    """The loops to time (name -> forward pass from tokens [rows] to logits [rows, vocab], and
    the prompted caches it runs on), with the caches and first tokens for ``rows`` rows."""
    import mlx.core as mx

    loops: dict[str, tuple[Callable[[Any], Any], Any]] = {}
    if rows > 1:
        ours_rows, theirs_rows = _Rows(ours, rows, _our_batch), _Rows(theirs, rows, _their_batch) if theirs else None
        first = mx.repeat(first, rows)
        taken = decoder.rows(first[:, None], ours_rows.cache) if decoder is not None else None
        if taken is not None:  # the compiled step takes these caches
            mx.eval(taken, [c.state for c in ours_rows.cache])
            loops["engine compiled"] = (lambda t: decoder.rows(t[:, None], ours_rows.cache), ours_rows)
        ours_rows.trim()
        loops["engine plain"] = (lambda t: model(t[:, None], cache=ours_rows.cache)[:, -1], ours_rows)
        if theirs_rows is not None:
            loops["mlx-lm"] = (lambda t: twin(t[:, None], cache=theirs_rows.cache)[:, -1], theirs_rows)
        return ours_rows, theirs_rows, first, loops
    if decoder is not None:
        loops["engine compiled"] = (lambda t: decoder(t, ours.cache), ours)
    loops["engine plain"] = (lambda t: model(t[None], cache=ours.cache)[:, -1], ours)
    if theirs is not None:
        loops["mlx-lm"] = (lambda t: twin(t[None], cache=theirs.cache)[:, -1], theirs)
    return ours, theirs, first, loops


def part_rows(
    model: Any, twin: Any | None, ours: Any, theirs: Any | None, n: int, rows: int = 1
) -> dict[str, dict[str, Any]]:
    """Each part of a layer timed alone on both models (ms per call, ``rows`` rows of one
    token each), times the number of layers that have it; the first layer of each kind
    stands for the rest."""
    import mlx.core as mx

    layers = list(model.layers)
    their_layers = list(twin.layers) if twin is not None else [None] * len(layers)
    hidden = model.args.hidden_size
    x = (mx.random.normal((rows, 1, hidden), key=mx.random.key(1)) * 0.5).astype(mx.bfloat16)
    mx.eval(x)
    rows: dict[str, dict[str, Any]] = {}

    def add(name: str, count: int, fn: Callable[[], Any], their_fn: Callable[[], Any] | None, cached=False) -> None:
        row: dict[str, Any] = {
            "layers": count,
            "engine": count * 1000 * time_calls(fn, n, ours.trim if cached else lambda: None),
        }
        if their_fn is not None and theirs is not None:
            row["mlx-lm"] = count * 1000 * time_calls(their_fn, n, theirs.trim if cached else lambda: None)
        rows[name] = row

    # Attention: every layer has one, each on its own cache holding the prompt.
    attn, their_attn = layers[-1].self_attn, their_layers[-1].self_attn if twin is not None else None
    add(
        "attention",
        len(layers),
        lambda: attn(x, None, ours.cache[-1]),
        (lambda: their_attn(x, None, theirs.cache[-1])) if their_attn is not None and theirs is not None else None,
        cached=True,
    )
    ours.rewind()
    if theirs is not None:
        theirs.rewind()
    if hasattr(attn, "latent_attention"):
        _latent_attention_forms(add, attn, ours, len(layers))
    kinds: dict[str, list[int]] = collections.defaultdict(list)
    for i, layer in enumerate(layers):
        kinds["moe" if "gate" in layer.mlp and "switch_mlp" in layer.mlp else "dense"].append(i)
    for kind, indices in kinds.items():
        i = indices[0]
        for name, (ours, theirs) in _layer_parts(layers[i], their_layers[i], x).items():
            add(name, len(indices), ours, theirs)
    norm, their_norm = model.model.norm, twin.model.norm if twin is not None else None
    add(
        "final norm + head",
        1,
        lambda: model.logits(norm(x)),
        (lambda: twin.lm_head(their_norm(x))) if twin is not None and "lm_head" in twin else None,
    )
    print(f"{'part (x layers)':<32} {'engine ms':>10} {'mlx-lm ms':>10}")
    for name, row in rows.items():
        theirs = f"{row['mlx-lm']:10.3f}" if "mlx-lm" in row else f"{'-':>10}"
        print(f"{name + ' x' + str(row['layers']):<32} {row['engine']:10.3f} {theirs}", flush=True)
    return rows


def _latent_attention_forms(add: Callable[..., None], attn: Any, ours: _Prompted, count: int) -> None:
    """Latent attention alone over the prompt's cached latents, through MLX's fused call
    and through the composed form (``mla.composed_latent_attention``), ours only."""
    import mlx.core as mx

    from engine.models import mla

    latent, k_pe = ours.cache[-1].held()
    k = iter(mx.random.split(mx.random.key(2), 2))
    q_latent = mx.random.normal((1, attn.n_heads, 1, attn.kv_lora_rank), key=next(k)).astype(latent.dtype)
    q_pe = mx.random.normal((1, attn.n_heads, 1, attn.rope_dims), key=next(k)).astype(latent.dtype)
    mx.eval(q_latent, q_pe)
    saved = mla.COMPOSE
    try:
        for name, compose in (("latent attention fused", False), ("latent attention composed", True)):
            mla.COMPOSE = compose
            add(name, count, lambda: attn.latent_attention(q_latent, q_pe, latent, k_pe, None, True), None)
    finally:
        mla.COMPOSE = saved
