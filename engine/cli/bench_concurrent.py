"""``python -m engine bench --concurrent 1,2,4,8``: several streams decoding together.

For each count N, N random prompts of ``-p`` tokens start at once and each generates
``-g`` tokens (end-of-sequence ignored) through the engine's continuous batching
(engine.decode.batch, driven round by round as the worker drives it: each sequence takes
its tokens, then the batch steps, prefilling the waiting prompts together). ``--vs mlx-lm`` runs mlx-lm's
own ``BatchGenerator`` (what ``batch_generate`` and ``mlx_lm.server`` batch with) on the
same weights, the two interleaved run by run.

Reported per N, both sides measured the same way on the same prompts (after a warm-up
of every batch width): decode tok/s, "total" (tokens produced once every stream has its
first token, over the time since: the figure the bar is about), per-stream tok/s (that
over N), prefill (the N prompts' tokens over the time until the last stream's first
token, which is also the slowest time to first token) and end-to-end tok/s (all tokens
over the whole run, prefill included).

``--shared-prompt``: the streams share the ``-p`` token prompt (a system prompt and tools),
each adding its own 32-token question, and the prompt is cached before they start, as a
server that has answered once holds it (``--shared-prompt cold``: not cached; with
``--paged-kv`` the engine prefills it once for all the streams arriving together). The engine takes it from its block pool (with
``--paged-kv``: each stream prefills only its question, and the batch holds the prompt
once and reads it once per step for all rows; an ``own-copy`` row runs the same batch
with each row holding its own copy), mlx-lm from its ``LRUPromptCache`` as its server
does (a copy per stream). Each row then also gives the run's peak memory. ``--prompts K``
gives the streams K such prompts in turn (stream i the (i mod K)-th: K kinds of agent), all
cached alike.

``--profile`` also prints where the engine's time goes per decode step (building and
queueing the step, of which picking the tokens; waiting for the previous step's tokens;
the callers' side of a round) and per prefill pass, with mlx-lm's own prompt and decode
timers beside it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.cli.numbers import whole
from engine.errors import EngineError


@dataclass
class Concurrent:
    streams: int
    generated_tokens: int
    total_tps: float  # decode, all streams together, once every stream has started
    per_stream_tps: float
    end_to_end_tps: float
    ttft_max_s: float
    prefill_tps: float  # the prompts' tokens over the time until every stream had its first token
    tokens: list[list[int]]  # each stream's ids (compared with mlx-lm's, not printed)
    profile: dict[str, float] | None = None  # per-step timings (--profile)
    peak_gb: float = 0.0  # MLX's peak memory during the run (weights included)


# A stream's own question after a shared prompt (--shared-prompt).
QUESTION_TOKENS = 32
# Different shared prompts at most (--prompts).
MAX_SHARED_PROMPTS = 16

# Given a stream's whole prompt: the cache it starts from and the ids still to prefill.
CacheFor = Callable[[Any], tuple[Any, Any]]


def add_concurrent_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--concurrent", metavar="N,N,...", help="streams decoding together, e.g. 1,2,4,8 (continuous batching)"
    )
    p.add_argument(
        "--stagger",
        type=whole("--stagger", 0, 1 << 20),
        default=0,
        metavar="K",
        help="with --concurrent: stream i arrives after i*K decode steps (rows of different lengths: "
        "the padded, masked batch step), on both sides",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="with --concurrent: time each decode step's parts (launch, sample, settle) and each prefill pass; "
        "with a DiffusionGemma shape: one denoising step's parts (attention, feed-forward, experts, head, sampler)",
    )
    p.add_argument(
        "--shared-prompt",
        nargs="?",
        const="cached",
        choices=("cached", "cold"),
        help=f"with --concurrent: the streams share the -p token prompt, each adding its own {QUESTION_TOKENS}-token "
        "question; 'cached' (the default) caches the prompt before they start (the engine's block pool with "
        "--paged-kv, mlx-lm's prompt cache), 'cold' does not (the streams arrive together with a new prompt)",
    )
    p.add_argument(
        "--prompts",
        type=whole("--prompts", 1, MAX_SHARED_PROMPTS),
        default=1,
        metavar="K",
        help="with --shared-prompt: K different -p token prompts, stream i taking the (i mod K)-th",
    )


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise EngineError(f"--concurrent takes stream counts like 1,2,4,8 (got {text!r})")
    return counts


def _summary(
    prompts: Sequence[Any],
    start: float,
    firsts: Sequence[float],
    stamps: Sequence[float],
    tokens: list[list[int]],
    arrivals: Sequence[float] | None = None,
) -> Concurrent:
    n = len(prompts)
    end = max(stamps)
    all_started = max(firsts)
    after = sum(1 for t in stamps if t > all_started)
    total = after / max(end - all_started, 1e-9) if after else 0.0
    arrived = arrivals if arrivals is not None else [start] * n
    return Concurrent(
        streams=n,
        generated_tokens=len(stamps),
        total_tps=total,
        per_stream_tps=total / n,
        end_to_end_tps=len(stamps) / max(end - start, 1e-9),
        ttft_max_s=max(f - a for f, a in zip(firsts, arrived, strict=True)),
        prefill_tps=sum(int(p.size) for p in prompts) / max(all_started - start, 1e-9),
        tokens=tokens,
    )


def run_ours(
    model: Any,
    prompts: Sequence[Any],
    gen: int,
    chunk: int = 2048,
    compiled: bool | None = None,
    stagger: int = 0,
    cache_for: CacheFor | None = None,
    share: bool = True,
) -> Concurrent:
    """The engine's batch at token level (what the worker drives, without the text layer);
    with ``stagger``, stream i arrives at round i * stagger; ``cache_for`` gives each
    stream's starting cache (default: empty); without ``share`` rows never hold a shared
    prefix once."""
    import mlx.core as mx

    from engine.decode.batch import WAIT, Batch
    from engine.models.kv_cache import make_prompt_cache

    batch = Batch(model, compiled=compiled)
    batch.shares_prefixes = batch.shares_prefixes and share
    cache_for = cache_for or (lambda p: (make_prompt_cache(model), p))
    mx.reset_peak_memory()
    start = time.perf_counter()
    sequences: dict[int, Any] = {}
    arrivals = [start] * len(prompts)
    firsts = [0.0] * len(prompts)
    stamps: list[float] = []
    tokens: list[list[int]] = [[] for _ in prompts]
    callers = 0.0  # the callers' side of the rounds (reading tokens), outside ``step``
    rounds = 0
    while sequences or rounds <= (len(prompts) - 1) * stagger:
        for i, p in enumerate(prompts):
            if i * stagger == rounds:
                arrivals[i] = time.perf_counter()
                cache, rest = cache_for(p)
                sequences[i] = batch.sequence(
                    rest,
                    cache,
                    max_tokens=gen,
                    prefill_chunk=chunk,
                    sampler=lambda x: mx.argmax(x, axis=-1),
                    greedy=True,
                )
        rounds += 1
        began = time.perf_counter()
        for i, seq in list(sequences.items()):
            for item in seq:
                if item is WAIT:
                    break
                token, _ = item
                now = time.perf_counter()
                firsts[i] = firsts[i] or now
                stamps.append(now)
                tokens[i].append(token)
            else:
                del sequences[i]
        callers += time.perf_counter() - began
        batch.step()
    out = _summary(prompts, start, firsts, stamps, tokens, arrivals)
    out.profile = _our_profile(batch, callers)
    out.peak_gb = mx.get_peak_memory() / 1e9
    return out


def engine_prompt_cache(model: Any, shared: Sequence[Any]) -> CacheFor:
    """Streams starting from what the model's block pool holds of their prompts, after one
    request over each of ``shared`` published its blocks (nothing without a pool: each
    prefills all)."""
    from engine.cli.bench_shared import one_chat
    from engine.runtime.prefix_cache import PrefixCache

    for ids in shared:
        one_chat(model, ids[:-1], ids[-1:], 2, time.perf_counter())

    def cache_for(prompt: Any) -> tuple[Any, Any]:
        chat = PrefixCache(model)
        keep = chat.reuse(prompt.tolist())
        return chat.cache, prompt[keep:]

    return cache_for


def mlx_lm_prompt_cache(model: Any, shared: Sequence[Any], chunk: int = 2048) -> CacheFor:
    """Streams starting from mlx-lm's ``LRUPromptCache`` holding each of ``shared``, as its
    server fetches them (each a copy of the cached prompt)."""
    import mlx.core as mx
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    lru = LRUPromptCache(max_size=max(len(shared), 10))
    for prompt in shared:
        cache = make_prompt_cache(model)
        ids = prompt.tolist()
        for lo in range(0, len(ids), chunk):
            model(mx.array(ids[lo : lo + chunk])[None], cache=cache)
            mx.eval([c.state for c in cache])
        lru.insert_cache("bench", ids, cache)

    def cache_for(prompt: Any) -> tuple[Any, Any]:
        found, rest = lru.fetch_nearest_cache("bench", prompt.tolist())
        return found, rest

    return cache_for


def _our_profile(batch: Any, callers: float) -> dict[str, float]:
    t = batch.times
    steps, passes = max(t.launches, 1), max(t.prefills, 1)
    return {
        "decode_steps": t.launches,
        "mean_rows": t.rows_stepped / steps,
        "launch_ms": 1000 * t.launch_s / steps,
        "sample_ms": 1000 * t.sample_s / steps,
        "queue_ms": 1000 * t.queue_s / steps,
        "masked_steps": t.masked,
        "settle_ms": 1000 * t.settle_s / steps,
        "callers_ms": 1000 * callers / steps,
        "prefill_passes": t.prefills,
        "prefill_ms": 1000 * t.prefill_s / passes,
        "prefill_tokens_per_pass": t.prefill_tokens / passes,
    }


def run_mlx_lm(
    model: Any,
    prompts: Sequence[Any],
    gen: int,
    chunk: int = 2048,
    stagger: int = 0,
    cache_for: CacheFor | None = None,
) -> Concurrent:
    """mlx-lm's BatchGenerator: the continuous batching behind its server and batch_generate;
    with ``stagger``, stream i arrives after i * stagger of its generation steps;
    ``cache_for`` as in ``run_ours`` (its server's prompt cache)."""
    import mlx.core as mx

    try:
        from mlx_lm.generate import BatchGenerator
    except ImportError:
        raise EngineError("--vs mlx-lm needs mlx-lm: pip install 'mlx-desk[bench]' (or mlx-lm)") from None

    generator = BatchGenerator(
        model,
        stop_tokens=None,
        prefill_step_size=chunk,
        completion_batch_size=max(32, len(prompts)),
        prefill_batch_size=8,
    )
    start = time.perf_counter()
    arrivals = [start] * len(prompts)
    index: dict[int, int] = {}
    pending = list(range(len(prompts)))
    firsts = [0.0] * len(prompts)
    stamps: list[float] = []
    tokens: list[list[int]] = [[] for _ in prompts]
    calls = 0
    mx.reset_peak_memory()
    try:
        with generator.stats() as stats:
            while True:
                while pending and pending[0] * stagger <= calls:
                    i = pending.pop(0)
                    arrivals[i] = time.perf_counter()
                    ids = prompts[i].tolist()
                    cache, rest = cache_for(prompts[i]) if cache_for is not None else (None, ids)
                    held = len(ids) - len(rest)
                    (uid,) = generator.insert([list(rest)], [gen], caches=[cache], all_tokens=[ids[:held]])
                    index[uid] = i
                responses = generator.next_generated()
                calls += 1
                if not responses:
                    if not pending:
                        break
                    calls = pending[0] * stagger  # nothing runs: the next one arrives now
                    continue
                now = time.perf_counter()
                for r in responses:
                    i = index[r.uid]
                    firsts[i] = firsts[i] or now
                    stamps.append(now)
                    tokens[i].append(int(r.token))
    finally:
        generator.close()
    out = _summary(prompts, start, firsts, stamps, tokens, arrivals)
    out.peak_gb = mx.get_peak_memory() / 1e9
    steps = max(stats.generation_steps, 1)
    out.profile = {
        "decode_steps": stats.generation_steps,
        "mean_rows": stats.generation_tokens / steps,
        "decode_ms": 1000 * stats.decode_time / steps,  # its whole step: launch, sample and settle
        "prefill_s": stats.prompt_time,
        "prefill_tps": stats.prompt_tps,
    }
    return out


def _row(name: str, c: Concurrent) -> str:
    return (
        f"{name:<8} x{c.streams:<3} total {c.total_tps:9.1f} tok/s   per stream {c.per_stream_tps:8.1f} tok/s   "
        f"prefill {c.prefill_tps:9.1f} tok/s   end-to-end {c.end_to_end_tps:9.1f} tok/s   "
        f"slowest ttft {c.ttft_max_s * 1000:8.1f} ms   peak {c.peak_gb:6.2f} GB"
    )


def _profile_row(name: str, c: Concurrent) -> str:
    p = c.profile or {}
    if "launch_ms" in p:
        return (
            f"  {name} x{c.streams}: {p['decode_steps']:.0f} steps of {p['mean_rows']:.2f} rows: "
            f"launch {p['launch_ms']:.3f} ms (sample {p['sample_ms']:.3f}, queue {p['queue_ms']:.3f}), "
            f"settle {p['settle_ms']:.3f} ms, callers {p['callers_ms']:.3f} ms per step, "
            f"{p['masked_steps']:.0f} steps masked; {p['prefill_passes']:.0f} prefill passes of "
            f"{p['prefill_tokens_per_pass']:.0f} tokens, {p['prefill_ms']:.3f} ms each on the host"
        )
    return (
        f"  {name} x{c.streams}: {p.get('decode_steps', 0):.0f} steps of {p.get('mean_rows', 0):.2f} rows: "
        f"{p.get('decode_ms', 0):.3f} ms per step; prefill {p.get('prefill_s', 0) * 1000:.1f} ms "
        f"({p.get('prefill_tps', 0):.1f} tok/s)"
    )


def run_concurrent(args: argparse.Namespace, model: Any, config: dict[str, Any], quantized: set[str]) -> dict[str, Any]:
    """Time every stream count in ``--concurrent`` (and mlx-lm's beside it with ``--vs``)."""
    import mlx.core as mx

    from engine.cli.bench import mlx_lm_twin
    from engine.decode.batch import batchable

    if not batchable(model):
        raise EngineError(f"--concurrent: {args.shape}'s caches do not batch (it decodes one request at a time)")
    counts = parse_counts(args.concurrent)
    import functools

    stagger = max(0, getattr(args, "stagger", 0) or 0)
    ours = functools.partial(
        run_ours,
        compiled=False if args.no_compile else None,
        stagger=stagger,
    )
    keys = mx.random.split(mx.random.key(args.seed), max(counts))
    shared = getattr(args, "shared_prompt", None)
    cached = shared == "cached"
    vocab, length = config["vocab_size"], QUESTION_TOKENS if shared else args.prompt_tokens
    prompts = [mx.random.randint(0, vocab, (length,), key=k).astype(mx.uint32) for k in keys]
    kinds = getattr(args, "prompts", 1) or 1
    if shared:  # the -p token prompt (one of ``kinds``), then each stream's question
        systems = [
            mx.random.randint(0, vocab, (args.prompt_tokens,), key=mx.random.key(args.seed + 1 + j)).astype(mx.uint32)
            for j in range(kinds)
        ]
        prompts = [mx.concatenate([systems[i % kinds], q]) for i, q in enumerate(prompts)]
    mx.eval(prompts)
    # One stream's prompt of each kind, its first question token included (what a request published).
    firsts = [prompts[j][: args.prompt_tokens + 1] for j in range(min(kinds, len(prompts)))]
    ours_from = engine_prompt_cache(model, firsts) if cached else None
    loops: list[tuple[str, Callable[..., Concurrent], Any]] = [
        ("engine", functools.partial(ours, cache_for=ours_from), model)
    ]
    if shared and getattr(model, "kv_pool", None) is not None:
        loops.append(("own-copy", functools.partial(ours, cache_for=ours_from, share=False), model))
    if args.vs == "mlx-lm":
        twin = mlx_lm_twin(model, config, quantized)
        theirs_from = mlx_lm_prompt_cache(twin, [f[:-1] for f in firsts]) if cached else None
        loops.append(("mlx-lm", functools.partial(run_mlx_lm, stagger=stagger, cache_for=theirs_from), twin))
    for _, run, m in loops:  # warm-up: kernels for every batch width
        for n in counts:
            run(m, prompts[:n], 3)
    out: dict[str, Any] = {"concurrent": []}
    for n in counts:
        best: dict[str, Concurrent] = {}
        for r in range(max(1, args.repeat)):
            for name, run, m in loops if r % 2 == 0 else loops[::-1]:
                mx.clear_cache()
                c = run(m, prompts[:n], args.generation_tokens)
                if name not in best or c.total_tps > best[name].total_tps:
                    best[name] = c
        profile = getattr(args, "profile", False)
        entry: dict[str, Any] = {
            name: {k: v for k, v in asdict(c).items() if k != "tokens" and (profile or k != "profile")}
            for name, c in best.items()
        }
        for name, c in best.items():
            print(_row(name, c), flush=True)
            if profile:
                print(_profile_row(name, c), flush=True)
        if "own-copy" in best:
            # The shared prefix attended apart changes only float rounding: the same ids.
            entry["same_tokens_as_own_copy"] = best["engine"].tokens == best["own-copy"].tokens
            print(f"shared   x{n:<3} same tokens as own copies: {entry['same_tokens_as_own_copy']}", flush=True)
        if "mlx-lm" in best:
            ratio = best["engine"].total_tps / max(best["mlx-lm"].total_tps, 1e-9)
            entry["ratio"] = ratio
            # Greedy on the same weights: the same ids, unless bf16 rounding splits a near-tie.
            entry["same_tokens_as_mlx_lm"] = best["engine"].tokens == best["mlx-lm"].tokens
            print(
                f"ratio    x{n:<3} total {ratio:.2f}x (engine / mlx-lm); same tokens: {entry['same_tokens_as_mlx_lm']}",
                flush=True,
            )
        out["concurrent"].append(entry)
    return out
