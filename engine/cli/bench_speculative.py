"""``python -m engine bench --speculative {ngram,draft,self,mtp}``: plain next to speculative decoding.

Random weights make drafts a poor guess, so each mode says what its numbers mean:

* ``self``: the model drafts for itself. Every greedy draft is accepted, so this is the upper
  bound of acceptance; the speed shows what verification in batches buys against the cost of
  drafting with a model as large as the target.
* ``draft``: the first ``--draft-layers`` layers of the same random model (sharing its
  embeddings, norm and head) draft for the whole model: a small model of the same vocabulary.
* ``mtp``: a multi-token-prediction layer (random, like the rest) on a Qwen3.5 / Qwen3-Next
  shape drafts from the target's hidden states; random guesses, so few are accepted: read
  its cost per round here and the upper bound from ``self``.
* ``ngram``: prompt lookup. The prompt is a random passage repeated, so lookup finds matches;
  whether they are accepted depends on the random model repeating it, which it seldom does.

``--vs mlx-lm`` times mlx-lm's ``speculative_generate_step`` with the same draft model (mlx-lm
has no n-gram drafting; only its plain loop runs then).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from engine.cli.bench import Timing, measure_interleaved, mlx_lm_twin, quantize_as_ours, with_runs
from engine.cli.numbers import whole

NOTES = {
    "self": "self: the model drafts for itself; greedy drafts are all accepted (the upper bound)",
    "draft": "draft: the first {layers} layers of the same random model draft for all {total}",
    "mtp": "mtp: a random built-in MTP layer drafts (random guesses: few accepted; see self for the upper bound)",
    "ngram": (
        "ngram: the prompt is a {passage}-token random passage repeated, so lookup finds matches; "
        "random weights seldom repeat it, so few drafts are accepted"
    ),
}


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        choices=["ngram", "draft", "self", "mtp"],
        help="also time speculative decoding: n-gram lookup, a draft model, the model itself, "
        "or a built-in MTP layer (Qwen3.5 and DeepSeek V3 shapes)",
    )
    from engine.decode.draft_depth import draft_count  # mlx-free

    p.add_argument(
        "--num-draft",
        type=draft_count,
        default=4,
        metavar="N|auto",
        help="drafts verified per pass (default 4), or auto: chosen each round from measured costs",
    )
    p.add_argument(
        "--ngram-size", type=whole("--ngram-size", 1, 256), default=3, help="ids matched by n-gram lookup (default 3)"
    )
    p.add_argument(
        "--draft-layers",
        type=whole("--draft-layers", 1, 1024),
        help="layers of the draft model (default 2, 1 for a 2-layer shape)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="decode through the compiled step on a CPU too (the default on a GPU only): each new "
        "size of pass then compiles on first use, as kernels are built on a GPU",
    )
    p.add_argument(
        "--verify-rows-alone",
        action="store_true",
        help="diagnostic: every matmul and attention of a verify pass runs one row at a time, as a "
        "one-token step runs it (engine/cli/verify_rows.py), to see whether MLX's row-count-dependent "
        "kernels are what part speculative from plain greedy in bf16, and what exactness would cost",
    )


def repeated_passage_prompt(vocab: int, length: int, seed: int) -> tuple[Any, int]:
    """A random passage repeated to ``length`` ids, and the passage's length."""
    import mlx.core as mx

    passage = max(4, min(64, length // 4))
    ids = mx.random.randint(0, vocab, (passage,), key=mx.random.key(seed + 1)).astype(mx.uint32)
    reps = -(-length // passage)
    return mx.tile(ids, (reps,))[:length], passage


def attach_random_mtp(model: Any, config: dict[str, Any]) -> None:
    """Give a Qwen3.5 / Qwen3-Next or DeepSeek V3 shaped model a random MTP layer, bf16 and
    quantized like it (DeepSeek's: routed experts, as the published checkpoints have)."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.errors import EngineError
    from engine.models.deepseek_mtp import NextNHead, mtp_args
    from engine.models.qwen3_5_mtp import MTPHead

    layers = getattr(getattr(model, "model", None), "layer_class", None)
    if not hasattr(model, "hidden_listener") or layers is None:
        raise EngineError(
            "--speculative mtp needs a Qwen3.5, Qwen3-Next or DeepSeek V3 shape "
            "(e.g. --shape qwen3.5-4b or moonlight-16b-a3b)"
        )
    if hasattr(model.args, "num_nextn_predict_layers"):  # DeepSeek V3 and its kin
        n = model.args.num_hidden_layers
        full = mtp_args(model.args, {f"model.layers.{n}.mlp.gate.weight": None})
        model.mtp = NextNHead(model.args, layers(full, n), model.logits)
    else:
        model.mtp = MTPHead(model.args, layers)
    model.mtp.set_dtype(mx.bfloat16)
    q = config.get("quantization")
    if q:
        group = q["group_size"]
        nn.quantize(
            model.mtp,
            group_size=group,
            bits=q["bits"],
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group == 0,
        )
    mx.eval(model.mtp.parameters())


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def slice_model(
    model: Any, config: dict[str, Any], quantized: set[str], layers: int | None
) -> tuple[Any, dict, set[str]]:
    """The first ``layers`` layers of ``model`` with its embeddings, norm and head: a draft model
    that shares the target's weight arrays (no copies)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.errors import EngineError
    from engine.models import get_family

    total = int(config["num_hidden_layers"])
    layers = layers if layers is not None else min(2, total - 1)
    if not 1 <= layers < total:
        raise EngineError(f"--draft-layers must be between 1 and {total - 1} for this shape (got {layers})")
    draft_config = {k: v for k, v in config.items() if k != "quantization"}
    draft_config["num_hidden_layers"] = layers
    family = get_family(config["model_type"])
    draft = family.Model(family.ModelArgs.from_dict(draft_config))
    draft.set_dtype(mx.bfloat16)

    def kept(path: str) -> bool:
        m = _LAYER.search(path)
        return m is None or int(m.group(1)) < layers

    draft_quantized = {p for p in quantized if kept(p + ".")}
    quantize_as_ours(draft, config, draft_quantized)
    if quantized:
        draft_config["quantization"] = dict(config["quantization"])
    weights = [(k, v) for k, v in tree_flatten(model.parameters()) if kept(k)]
    draft.load_weights(weights, strict=True)
    mx.eval(draft.parameters())
    return draft, draft_config, draft_quantized


def _recording(
    loop: Callable[[Any, Any, int], Iterator[int]], sink: list[int]
) -> Callable[[Any, Any, int], Iterator[int]]:
    def run(model: Any, prompt: Any, gen: int) -> Iterator[int]:
        sink.clear()
        for token in loop(model, prompt, gen):
            sink.append(token)
            yield token

    return run


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first generated token (0-based) where two runs part, None when they are equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def _ours_plain(model: Any, prompt: Any, gen: int, compiled: bool | None = None) -> Iterator[int]:
    from engine.decode.loop import generate_step
    from engine.models.kv_cache import make_prompt_cache

    for token, _ in generate_step(
        prompt, model, make_prompt_cache(model), max_tokens=gen, prefill_chunk=2048, compiled=compiled
    ):
        yield token


def _ours_speculative(
    make_drafter: Callable[[], Any],
    num_draft: int,
    stats_out: list[Any],
    auto: bool = False,
    compiled: bool | None = None,
):
    def run(model: Any, prompt: Any, gen: int) -> Iterator[int]:
        from engine.decode.draft_depth import DraftDepth
        from engine.decode.speculative import speculative_step
        from engine.decode.stats import StatsCounter
        from engine.models.kv_cache import make_prompt_cache

        stats = StatsCounter()
        depth = DraftDepth(num_draft) if auto else None
        stats_out[:] = [stats, depth]
        drafter = make_drafter()
        try:
            for token, _ in speculative_step(
                prompt.tolist(),
                model,
                make_prompt_cache(model),
                drafter,
                max_tokens=gen,
                num_draft_tokens=num_draft,
                stats=stats,
                prefill_chunk=2048,
                depth=depth,
                compiled=compiled,
            ):
                yield token
        finally:
            getattr(drafter, "close", lambda: None)()  # an MTP drafter stops following the model

    return run


def warm_rounds(
    model: Any, prompt: Any, make_drafter: Callable[[], Any], depths: Sequence[int], compiled: bool | None = None
) -> float:
    """Decode a few rounds at each of ``depths`` once, untimed, and return how long that took.

    A verify pass of k + 1 tokens (and a draft model's passes) runs through the compiled step,
    which traces each size on its first use (on a GPU, building its kernels too): a timed run
    would otherwise pay that once, in whichever run first chose the depth."""
    import time

    from engine.decode.speculative import speculative_step
    from engine.models.kv_cache import make_prompt_cache

    began = time.perf_counter()
    for k in depths:
        drafter = make_drafter()
        try:
            for _ in speculative_step(
                prompt.tolist(),
                model,
                make_prompt_cache(model),
                drafter,
                max_tokens=3 * (k + 1),  # two rounds: a draft model then feeds two ids a pass
                num_draft_tokens=k,
                prefill_chunk=2048,
                compiled=compiled,
            ):
                pass
        finally:
            getattr(drafter, "close", lambda: None)()
    return time.perf_counter() - began


def breakdown(spent: Any, spec: Timing, plain: Timing) -> dict[str, float]:
    """Where the adaptive run's decoding went (``engine.decode.draft_depth.Spent``), next to
    the plain loop's cost per token, in milliseconds. ``unaccounted``: the generation time that
    no plain token, round or catching up measured (the consumer, and switching between them)."""
    generation = (spec.generated_tokens - 1) / spec.generation_tps if spec.generation_tps > 0 else 0.0
    per_plain = 1 / plain.generation_tps if plain.generation_tps > 0 else 0.0
    ms = 1000.0
    return {
        "generation_ms": generation * ms,
        "plain_tokens": spent.plain_tokens,
        "plain_ms": spent.plain_seconds * ms,
        "plain_ms_per_token": spent.plain_seconds / max(1, spent.plain_tokens) * ms,
        "plain_loop_ms_per_token": per_plain * ms,
        "rounds": spent.rounds,
        "round_tokens": spent.round_tokens,
        "round_ms": spent.round_seconds * ms,
        "catch_up_ids": spent.catch_up_ids,
        "catch_up_ms": spent.catch_up_seconds * ms,
        "first_use_rounds": spent.first_uses,
        "first_use_ms": spent.first_use_seconds * ms,
        "unaccounted_ms": (generation - spent.seconds) * ms,
        "as_plain_ms": (spec.generated_tokens - 1) * per_plain * ms,
    }


def _breakdown_lines(b: dict[str, float]) -> list[str]:
    return [
        f"where the time went ({b['generation_ms']:.1f} ms after the first token; plain decoding took "
        f"{b['as_plain_ms']:.1f} ms):",
        f"  plain tokens   {b['plain_tokens']:>5} in {b['plain_ms']:8.1f} ms, {b['plain_ms_per_token']:.2f} ms each "
        f"(the plain loop: {b['plain_loop_ms_per_token']:.2f} ms)",
        f"  rounds         {b['rounds']:>5} in {b['round_ms']:8.1f} ms, yielding {b['round_tokens']} tokens "
        f"({b['first_use_rounds']} first use of a pass size: {b['first_use_ms']:.1f} ms)",
        f"  catching up    {b['catch_up_ids']:>5} ids in {b['catch_up_ms']:8.1f} ms",
        f"  unaccounted          {b['unaccounted_ms']:8.1f} ms",
    ]


def _theirs_plain(model: Any, prompt: Any, gen: int) -> Iterator[int]:
    from mlx_lm.generate import generate_step

    for token, _ in generate_step(prompt, model, max_tokens=gen, prefill_step_size=2048):
        yield int(token)


def _theirs_speculative(draft: Any, num_draft: int, from_draft: list[int]):
    def run(model: Any, prompt: Any, gen: int) -> Iterator[int]:
        from mlx_lm.generate import speculative_generate_step

        from_draft[:] = [0]
        for token, _, drafted in speculative_generate_step(
            prompt, model, draft, num_draft_tokens=num_draft, max_tokens=gen, prefill_step_size=2048
        ):
            from_draft[0] += int(bool(drafted))
            yield int(token)

    return run


def _depths(depth: Any) -> str:
    """What the adaptive depth chose in the last run: how often it asked for each depth, and
    how many rounds were verified."""
    from collections import Counter

    asked = Counter(depth.chosen)
    shown = ", ".join(f"{n} x {k}" for k, n in sorted(asked.items())) or "none"
    # An n-gram lookup that finds nothing asked for is no round: it decodes plainly on.
    return (
        f"auto depth: drafts asked for {shown}, {depth.spent.rounds} rounds verified; "
        f"acceptance estimate {depth.acceptance:.0%}"
    )


def _row(name: str, t: Timing) -> str:
    return (
        f"{name:<16} prompt {t.prompt_tps:10.1f} tok/s   generation {t.generation_tps:8.1f} tok/s   "
        f"ttft {t.ttft_s * 1000:8.1f} ms   peak {t.peak_memory_bytes / 1e9:6.2f} GB"
    )


def run_speculative(
    args: argparse.Namespace, model: Any, config: dict[str, Any], quantized: set[str], prompt: Any
) -> dict[str, Any]:
    """Time plain and speculative decoding (and mlx-lm's, with ``--vs mlx-lm``); print the table
    and return the figures for ``--json``."""
    if getattr(args, "verify_rows_alone", False):
        from engine.cli.verify_rows import rows_alone

        print("verify passes run each row alone (--verify-rows-alone)", flush=True)
        with rows_alone():  # before anything is traced: the compiled steps keep what they trace
            return _run(args, model, config, quantized, prompt)
    return _run(args, model, config, quantized, prompt)


def _run(
    args: argparse.Namespace, model: Any, config: dict[str, Any], quantized: set[str], prompt: Any
) -> dict[str, Any]:
    import mlx.core as mx

    from engine.decode.draft_depth import AUTO_MAX_DRAFT, auto_depths
    from engine.decode.drafters import DraftModelDrafter, NgramDrafter
    from engine.errors import EngineError

    mode, k, gen, repeat = args.speculative, args.num_draft, args.generation_tokens, args.repeat
    # --no-compile: the plain forward pass only; --compiled: the compiled step on a CPU too.
    compiled = False if args.no_compile else (True if args.compiled else None)
    auto = k == "auto"
    if auto:  # drafts per round chosen as the run goes, up to this many
        k = AUTO_MAX_DRAFT
    if k < 1 or args.ngram_size < 1:
        raise EngineError("--num-draft and --ngram-size must be at least 1")
    note = NOTES[mode]
    draft = draft_config = None
    if mode == "ngram":
        prompt, passage = repeated_passage_prompt(config["vocab_size"], int(prompt.size), args.seed)
        mx.eval(prompt)
        note = note.format(passage=passage)
        make_drafter = lambda: NgramDrafter(args.ngram_size, k)  # noqa: E731
    elif mode == "draft":
        draft, draft_config, draft_quantized = slice_model(model, config, quantized, args.draft_layers)
        note = note.format(layers=draft_config["num_hidden_layers"], total=config["num_hidden_layers"])
        make_drafter = lambda: DraftModelDrafter(draft, None, k, 2048)  # noqa: E731
    elif mode == "mtp":
        from engine.decode.mtp_drafter import MTPDrafter

        attach_random_mtp(model, config)
        make_drafter = lambda: MTPDrafter(model, k)  # noqa: E731
    else:
        draft = model
        make_drafter = lambda: DraftModelDrafter(model, None, k, 2048)  # noqa: E731
    print(note, flush=True)

    plain_ids: list[int] = []
    spec_ids: list[int] = []
    stats: list[Any] = []
    loops = [
        (_recording(lambda m, p, g: _ours_plain(m, p, g, compiled), plain_ids), model),
        (_recording(_ours_speculative(make_drafter, k, stats, auto, compiled), spec_ids), model),
    ]
    from_draft: list[int] = [0]
    if args.vs == "mlx-lm":  # every loop runs in each repeat, in alternating order
        twin = mlx_lm_twin(model, config, quantized)
        loops.append((_theirs_plain, twin))
        if draft is not None:
            draft_twin = twin if draft is model else mlx_lm_twin(draft, draft_config, draft_quantized)
            loops.append((_theirs_speculative(draft_twin, k, from_draft), twin))
    depths = auto_depths(k) if auto else (k,)  # the depths the run may choose
    warm = warm_rounds(model, prompt, make_drafter, depths, compiled)
    print(f"warm-up: rounds of {', '.join(map(str, depths))} drafts once, untimed: {warm * 1000:.0f} ms", flush=True)
    errors: dict[int, str] = {}  # mlx-lm's loops that could not run, and why (the engine's figures stand)
    timed = measure_interleaved(loops, prompt, gen, repeat, errors, peers_from=2)
    assert timed[0] is not None and timed[1] is not None  # the engine's own failure ends the bench
    plain, spec = timed[0][0], timed[1][0]
    print(_row("engine", plain), flush=True)
    print(_row(f"engine+{mode}", spec), flush=True)
    s, depth = stats
    diverged = first_difference(spec_ids, plain_ids)
    same = diverged is None
    spent = None
    if depth is not None:
        print(f"{'':<16} {_depths(depth)}", flush=True)
        # The last speculative run's figures, against the plain loop's last run.
        spent = breakdown(depth.spent, timed[1][1][-1], timed[0][1][-1])
        for line in _breakdown_lines(spent):
            print(f"{'':<16} {line}", flush=True)
    print(
        f"{'':<16} {s.accepted_draft_tokens}/{s.draft_tokens} drafts accepted ({s.acceptance_rate:.0%}), "
        f"speed-up {spec.generation_tps / max(plain.generation_tps, 1e-9):.2f}x, "
        f"tokens identical to plain greedy: {'yes' if same else f'no, first differing at token {diverged}'}",
        flush=True,
    )
    out: dict[str, Any] = {
        "speculative": {
            "mode": mode,
            "num_draft": "auto" if auto else k,
            "depths_chosen": list(depth.chosen) if depth is not None else None,
            "breakdown": spent,
            "warm_up_ms": warm * 1000,
            "note": note,
            "plain": with_runs(*timed[0]),
            "engine": with_runs(*timed[1]),
            "draft_tokens": s.draft_tokens,
            "accepted_draft_tokens": s.accepted_draft_tokens,
            "acceptance_rate": s.acceptance_rate,
            "identical_to_plain": same,
            "first_difference": diverged,
            "speedup": spec.generation_tps / max(plain.generation_tps, 1e-9),
        }
    }
    if args.vs != "mlx-lm":
        return out
    if timed[2] is None:
        print(f"{'mlx-lm':<16} could not run this shape: {errors[2]}", flush=True)
        return {**out, "mlx_lm": None, "mlx_lm_error": errors[2]}
    theirs = timed[2][0]
    print(_row("mlx-lm", theirs), flush=True)
    out["mlx_lm"] = with_runs(*timed[2])
    if draft is None:
        print(f"{'':<16} mlx-lm has no {mode} drafting: its plain loop only", flush=True)
        return out
    if timed[3] is None:
        print(f"{'mlx-lm+' + mode:<16} could not run this shape: {errors[3]}", flush=True)
        return {**out, "mlx_lm_speculative": None, "mlx_lm_error": errors[3], "ratio_speculative": None}
    theirs_spec = timed[3][0]
    print(_row(f"mlx-lm+{mode}", theirs_spec), flush=True)
    ratio = spec.generation_tps / max(theirs_spec.generation_tps, 1e-9)
    print(
        f"{'':<16} {from_draft[0]}/{theirs_spec.generated_tokens} tokens from drafts, speed-up "
        f"{theirs_spec.generation_tps / max(theirs.generation_tps, 1e-9):.2f}x; "
        f"engine+{mode} / mlx-lm+{mode}: {ratio:.2f}x",
        flush=True,
    )
    out["mlx_lm_speculative"] = {**with_runs(*timed[3]), "tokens_from_draft": from_draft[0]}
    out["ratio_speculative"] = ratio
    return out
