"""``python -m engine.cli.bench_dflash --shape qwen3-4b --bits 4 --block 16``: what one DFlash
round costs against one plain decode step, and the acceptance it needs to pay.

Random weights of the shape (``engine.cli.bench``) and a random DFlash drafter of the
published layout for it (``--draft-layers`` layers, the target's width and heads; target
layers spaced as z-lab's ``build_target_layer_ids``), both quantized at ``--bits``. After a
``--context``-token prompt:

* plain step: one token through the model, as plain decoding runs it (the compiled step
  where it applies);
* DFlash round: the drafter's block pass (``--block`` positions) and the target's verify pass
  over the block (the compiled step where it applies, as the speculative loop runs it), with
  the target's layers read for the drafter (the tap on), evaluated together, the block's
  cache entries trimmed after;
* break-even: the tokens a round must yield (accepted drafts + 1) to match plain steps, and
  the per-draft acceptance that gives it (the geometric model of ``engine.decode.draft_depth``);
* upper bound: tokens/s when every draft is accepted (the drafter drafting the target's own
  greedy continuation), against plain tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.cli.bench_shapes import attention_heads


def target_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """Evenly spaced from layer 1 to the third from last, as z-lab chooses them (fewer on a
    target too shallow for that many)."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = min(1, target_layers - 1), max(min(1, target_layers - 1), target_layers - 3)
    return sorted({start + round(i * (end - start) / (draft_layers - 1)) for i in range(draft_layers)})


def drafter_config(config: dict[str, Any], layers: int, block: int) -> dict[str, Any]:
    """The published config.json of a DFlash drafter for the target ``config``."""
    heads, kv_heads, head_dim = attention_heads(config)
    return {
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": config.get("rope_theta", 1e6),
        "num_target_layers": config["num_hidden_layers"],
        "block_size": block,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
        "dflash_config": {
            "mask_token_id": int(config["vocab_size"]) - 1,
            "target_layer_ids": target_layer_ids(int(config["num_hidden_layers"]), layers),
        },
    }


def random_drafter(config: dict[str, Any], layers: int, block: int, bits: int, group_size: int) -> Any:
    import mlx.core as mx
    import mlx.nn as nn

    from engine.models.dflash import DFlashArgs, DFlashDraft

    args = DFlashArgs.from_config(drafter_config(config, layers, block))
    if bits != 16:
        args.quantization = {"bits": bits, "group_size": group_size}
    draft = DFlashDraft(args)
    draft.set_dtype(mx.bfloat16)
    if bits != 16:
        nn.quantize(draft, group_size=group_size, bits=bits)
    mx.eval(draft.parameters())
    return draft


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from engine.cli.bench_step import time_calls
    from engine.decode.dflash_drafter import DFlashDrafter
    from engine.decode.draft_depth import expected_tokens
    from engine.decode.drafters import decoder_for
    from engine.decode.prefill import prefill
    from engine.models.kv_cache import make_prompt_cache, trim_prompt_cache

    model, config, _ = build_model_for(args)
    draft = random_drafter(config, args.draft_layers, args.block, args.bits, args.group_size)
    vocab = int(config["vocab_size"])
    ids = mx.random.randint(0, vocab, (args.context + args.block,), key=mx.random.key(args.seed)).astype(mx.uint32)
    cache = make_prompt_cache(model)
    prefill(model, ids[: args.context], cache, chunk=512)
    token = ids[args.context : args.context + 1]

    decoder = decoder_for(model, None)

    def plain_step() -> Any:
        if decoder is not None:
            out = decoder(token, cache)
            if out is not None:
                return mx.argmax(out[-1])
        return mx.argmax(model(token[None], cache=cache)[0, -1])

    step_s = time_calls(plain_step, args.steps, after=lambda: trim_prompt_cache(cache, 1))

    drafter = DFlashDrafter(model, draft)
    try:
        history = [int(t) for t in ids[: args.context + 1].tolist()]
        drafter._passes = [
            (0, mx.zeros((1, args.context, len(draft.args.target_layer_ids) * int(config["hidden_size"]))))
        ]
        drafter._add_rows(args.context)  # context rows for the prompt (their values do not matter for timing)

        def dflash_round() -> Any:
            logits = drafter.block_logits(history[-1])
            drafts = mx.argmax(logits, axis=-1).astype(mx.uint32)
            block = mx.concatenate([token, drafts])
            out = decoder(block, cache) if decoder is not None else None  # as the speculative loop verifies
            verified = mx.argmax(out if out is not None else model(block[None], cache=cache)[0], axis=-1)
            return verified, drafts

        def undo() -> None:
            trim_prompt_cache(cache, args.block)
            drafter._passes = []

        round_s = time_calls(dflash_round, args.steps, after=undo)
    finally:
        drafter.close()

    needed = round_s / step_s
    drafts = args.block - 1
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_tokens rises with acceptance: bisect for the break-even
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, drafts) < needed else (lo, mid)
    return {
        "shape": args.shape,
        "bits": args.bits,
        "block": args.block,
        "draft_layers": args.draft_layers,
        "context": args.context,
        "device": str(mx.default_device()),
        "plain_step_ms": step_s * 1000,
        "dflash_round_ms": round_s * 1000,
        "round_over_step": needed,
        "break_even_tokens_per_round": needed,
        "break_even_acceptance": hi if needed <= drafts + 1 else None,
        "plain_tok_s": 1 / step_s,
        "upper_bound_tok_s": args.block / round_s,
    }


def side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """``--vs mlx-vlm``: ours and mlx-vlm's DFlash generators (and plain decoding on each side)
    end to end on the same weights and prompt (``engine.cli.bench_dflash_mlx_vlm``)."""
    import mlx.core as mx

    from engine.cli import bench_dflash_mlx_vlm as peer
    from engine.cli.bench import _ours, measure_interleaved, with_runs

    model, config, quantized = build_model_for(args)
    twin = peer.target_twin(model, config, quantized)
    draft = random_drafter(config, args.draft_layers, args.block, args.bits, args.group_size)
    model.bench_draft, model.bench_block = draft, args.block
    twin.bench_draft = peer.drafter_twin(draft, drafter_config(config, args.draft_layers, args.block), twin, args.block)
    prompt = mx.random.randint(0, int(config["vocab_size"]), (args.context,), key=mx.random.key(args.seed))
    prompt = prompt.astype(mx.int32)
    loops = [(peer.ours_dflash, model), (peer.theirs_dflash, twin), (_ours, model), (peer.theirs_plain, twin)]
    names = ["engine_dflash", "mlx_vlm_dflash", "engine_plain", "mlx_vlm_plain"]
    gen = args.generation_tokens
    tokens = {name: peer.tokens_of(loop, m, prompt, gen) for name, (loop, m) in zip(names, loops)}
    timed = measure_interleaved(loops, prompt, gen, args.repeat)
    out: dict[str, Any] = {"shape": args.shape, "bits": args.bits, "block": args.block, "context": args.context}
    out["device"] = str(mx.default_device())
    for name, result in zip(names, timed):
        assert result is not None
        out[name] = with_runs(*result)
    out["dflash_ratio"] = out["engine_dflash"]["generation_tps"] / out["mlx_vlm_dflash"]["generation_tps"]
    out["plain_ratio"] = out["engine_plain"]["generation_tps"] / out["mlx_vlm_plain"]["generation_tps"]
    out["greedy_agreement"] = {
        "dflash": peer.agreement(tokens["engine_dflash"], tokens["mlx_vlm_dflash"]),
        "engine_dflash_vs_plain": peer.agreement(tokens["engine_dflash"], tokens["engine_plain"]),
        "mlx_vlm_dflash_vs_plain": peer.agreement(tokens["mlx_vlm_dflash"], tokens["mlx_vlm_plain"]),
        "of": gen,
    }
    return out


def build_model_for(args: argparse.Namespace) -> tuple[Any, dict[str, Any], set[str]]:
    from engine.cli.bench import build_model

    return build_model(args.shape, args.bits, args.group_size, args.seed)


def _print_side_by_side(out: dict[str, Any]) -> None:
    for name in ("engine_dflash", "mlx_vlm_dflash", "engine_plain", "mlx_vlm_plain"):
        t = out[name]
        print(
            f"{name:<15} generation {t['generation_tps']:8.1f} tok/s (median {t['median']['generation_tps']:.1f})"
            f"   prompt {t['prompt_tps']:10.1f} tok/s   peak {t['peak_memory_bytes'] / 1e9:6.2f} GB",
            flush=True,
        )
    agree = out["greedy_agreement"]
    print(
        f"DFlash, block {out['block']}: engine/mlx-vlm {out['dflash_ratio']:.2f}x; plain {out['plain_ratio']:.2f}x; "
        f"greedy tokens shared: DFlash {agree['dflash']}/{agree['of']}, engine DFlash vs plain "
        f"{agree['engine_dflash_vs_plain']}, mlx-vlm DFlash vs plain {agree['mlx_vlm_dflash_vs_plain']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    from engine.cli.bench_shapes import SHAPES

    p = argparse.ArgumentParser(prog="python -m engine.cli.bench_dflash", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--bits", type=int, default=4, help="4 or 8 (quantized), 16 for bf16")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--block", type=int, default=16, help="the drafter's block size (default 16)")
    p.add_argument("--draft-layers", type=int, default=5, help="the drafter's layers (default 5)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the timed passes")
    p.add_argument("--steps", type=int, default=20, help="timed calls per round of three")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument(
        "--vs",
        choices=["mlx-vlm"],
        help="also generate end to end with mlx-vlm's DFlash on the same weights (pip install mlx-vlm)",
    )
    p.add_argument("-g", "--generation-tokens", type=int, default=128, help="tokens generated a run (--vs)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each generator (--vs)")
    args = p.parse_args(argv)
    if args.vs:
        side = side_by_side(args)
        _print_side_by_side(side)
        if args.json:
            print(json.dumps(side))
        return 0
    out = measure(args)
    print(
        f"{out['shape']} {out['bits']}-bit on {out['device']}, {out['context']} tokens of context: "
        f"plain step {out['plain_step_ms']:.2f} ms, DFlash round (block {out['block']}, "
        f"{out['draft_layers']} drafter layers) {out['dflash_round_ms']:.2f} ms = {out['round_over_step']:.2f} steps",
        flush=True,
    )
    acc = out["break_even_acceptance"]
    print(
        f"break-even: {out['break_even_tokens_per_round']:.2f} tokens a round"
        + (f" (per-draft acceptance {acc:.0%})" if acc is not None else " (more than a block can yield)")
        + f"; all accepted: {out['upper_bound_tok_s']:.1f} tok/s against plain {out['plain_tok_s']:.1f} tok/s",
        flush=True,
    )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
