"""mlx-vlm's DFlash as the referee of ``bench_dflash --vs mlx-vlm``: its target model and its
DFlash drafter holding exactly our random weights, and its own speculative generator timed
next to ours on the same prompt, end to end.

Both sides draft a fixed block (mlx-vlm's ``prefer_requested_block_size``; our fixed depth of
block - 1), greedy. A random drafter's drafts are almost never accepted, so each round yields
one token on both sides and tokens/s is the inverse of what a whole round costs there:
drafter pass, verify pass, acceptance and the drafter's context rows, with each generator's
own bookkeeping. At a given acceptance both sides yield the same tokens a round, so this
ratio is the speed ratio at any acceptance. Both sides decode the target's greedy
continuation, so their tokens are compared too (bf16 rounding may part them late).

mlx-vlm 0.7.10's DFlash reads the target's hidden states through ``capture_layer_ids``, which
only some of its text models implement (Qwen3.5, Gemma 4, ...); its Qwen3 and Llama models
take the argument and drop it, so as shipped it cannot run the published Qwen3 and Llama
drafters at all. ``tap_layers`` gives its model what those families lack: the output of each
named layer, as its Qwen3.5 model captures them, with the model's own forward unchanged.
Its DFlash generator then runs as shipped.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterator
from typing import Any

from engine.cli.bench import quantize_as_ours
from engine.errors import EngineError

_NEST = "language_model."


def _import_mlx_vlm() -> None:
    if importlib.util.find_spec("mlx_vlm") is None:
        raise EngineError("--vs mlx-vlm needs mlx-vlm: pip install mlx-vlm")


def target_twin(model: Any, config: dict[str, Any], quantized: set[str]) -> Any:
    """mlx-vlm's text model for ``config``'s family, holding exactly ``model``'s weights."""
    _import_mlx_vlm()
    import mlx.core as mx
    from mlx.utils import tree_flatten

    try:
        family = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    except ImportError:
        raise EngineError(f"mlx-vlm has no {config['model_type']} model to compare with") from None
    twin = family.Model(family.ModelConfig.from_dict({k: v for k, v in config.items() if k != "quantization"}))
    twin.set_dtype(mx.bfloat16)
    quantize_as_ours(twin, config, quantized, _NEST)
    try:
        twin.load_weights([(_NEST + k, v) for k, v in tree_flatten(model.parameters())], strict=True)
    except ValueError as e:
        raise EngineError(f"mlx-vlm's {config['model_type']} does not take our weights: {e}") from None
    mx.eval(twin.parameters())
    if "capture_layer_ids" not in inspect.signature(type(twin.language_model).__call__).parameters:
        tap_layers(twin)
    return twin


def tap_layers(twin: Any) -> None:
    """Make ``twin.language_model`` answer ``capture_layer_ids`` with the outputs of those layers."""
    lm = twin.language_model
    tap: dict[str, Any] = {"ids": frozenset(), "sink": []}

    for index, layer in enumerate(lm.model.layers):
        base = type(layer)

        def layer_call(self: Any, *a: Any, _index: int = index, _base: Any = base, **k: Any) -> Any:
            h = _base.__call__(self, *a, **k)
            if _index in tap["ids"]:
                tap["sink"].append(h)
            return h

        layer.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": layer_call})

    base_lm = type(lm)

    def lm_call(self: Any, *a: Any, capture_layer_ids: Any = None, **k: Any) -> Any:
        if capture_layer_ids is None:
            return base_lm.__call__(self, *a, **k)
        tap["ids"], tap["sink"] = frozenset(capture_layer_ids), []
        try:
            out = base_lm.__call__(self, *a, **k)
        finally:
            tap["ids"] = frozenset()
        out.hidden_states = tap["sink"]
        return out

    lm.__class__ = type(f"Tapped{base_lm.__name__}", (base_lm,), {"__call__": lm_call})


def drafter_twin(draft: Any, draft_config: dict[str, Any], target: Any, block: int) -> Any:
    """mlx-vlm's DFlash drafter holding exactly ``draft``'s weights, bound to ``target``,
    drafting ``block`` positions every round."""
    _import_mlx_vlm()
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig

    twin = DFlashDraftModel(DFlashConfig.from_dict(draft_config))
    twin.set_dtype(mx.bfloat16)
    ours = dict(tree_flatten(draft.parameters()))
    q = draft.args.quantization
    if q:
        nn.quantize(
            twin,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in ours,
        )
    try:
        twin.load_weights(list(ours.items()), strict=True)
    except ValueError as e:
        raise EngineError(f"mlx-vlm's DFlash drafter does not take our weights: {e}") from None
    mx.eval(twin.parameters())
    twin.bind(target)
    twin.prefer_requested_block_size = True  # no adaptive block size: both sides draft alike
    twin.requested_block = block
    return twin


def ours_dflash(model: Any, prompt: Any, max_tokens: int) -> Iterator[int]:
    """Our speculative loop with the DFlash drafter ``model.bench_draft`` at a fixed depth."""
    from engine.decode.dflash_drafter import DFlashDrafter
    from engine.decode.sampling import SamplingParams
    from engine.decode.speculative import speculative_step
    from engine.models.kv_cache import make_prompt_cache

    depth = model.bench_block - 1
    drafter = DFlashDrafter(model, model.bench_draft, depth)
    try:
        for token, _ in speculative_step(
            [int(t) for t in prompt.tolist()],
            model,
            make_prompt_cache(model),
            drafter,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0.0),
            num_draft_tokens=depth,
            prefill_chunk=2048,
        ):
            yield token
    finally:
        drafter.close()


def theirs_dflash(twin: Any, prompt: Any, max_tokens: int) -> Iterator[int]:
    """mlx-vlm's generate_step with its DFlash drafter ``twin.bench_draft``, greedy."""
    from mlx_vlm.generate.ar import generate_step

    draft = twin.bench_draft
    draft.accept_lens, draft.draft_lens = [], []
    for token, _ in generate_step(
        prompt[None],
        twin,
        None,
        None,
        max_tokens=max_tokens,
        temperature=0.0,
        prefill_step_size=2048,
        draft_model=draft,
        draft_kind="dflash",
        draft_block_size=draft.requested_block,
    ):
        yield from _ints(token)


def theirs_plain(twin: Any, prompt: Any, max_tokens: int) -> Iterator[int]:
    """mlx-vlm's generate_step without a drafter, greedy."""
    from mlx_vlm.generate.ar import generate_step

    for token, _ in generate_step(prompt[None], twin, None, None, max_tokens=max_tokens, temperature=0.0):
        yield from _ints(token)


def _ints(token: Any) -> Iterator[int]:
    """mlx-vlm yields an int, a one-element array or a list (a batch of one) per step."""
    if isinstance(token, int):
        yield token
    elif isinstance(token, list):
        yield from (int(t) for t in token)
    else:
        yield from (int(t) for t in token.reshape(-1).tolist())


def tokens_of(loop: Any, model: Any, prompt: Any, gen: int) -> list[int]:
    return [int(t) for t in loop(model, prompt, gen)][:gen]


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
