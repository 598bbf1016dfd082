"""``python -m engine generate``: its flags, and the run from prompt to printed text.

The prompt is text (tokenized as the tokenizer says) or ids; ``--chat`` wraps it in the chat
template with any ``--image``/``--audio``/``--video`` parts; adapters, a draft model, a saved
KV cache and sharding over several machines are flags of the one command. ``--json`` ends
with one JSON object (the CLI contract in DESIGN.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

from engine.cli.common import CliError, add_kv_arguments
from engine.cli.experts import add_resident_experts, json_experts
from engine.cli.numbers import memory_bytes
from engine.cli.paged_args import add_paged_arguments, paged_block_size, paged_where_possible

MAX_NGRAM = 256  # ids an n-gram lookup matches; prompt lookup uses 2-5
MAX_DRAFTS = 64  # drafts verified in one pass (auto picks at most 6); more only lengthens each pass


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers, like 1,2,3 (got {text!r})"
        ) from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("--prompt-ids must not be negative")
    return ids


def _adapter(text: str) -> tuple[str, float]:
    """``DIR`` or ``DIR:SCALE`` (the scale multiplies the adapter as trained; default 1)."""
    folder, sep, scale = text.rpartition(":")
    if sep and folder:
        try:
            return folder, float(scale)
        except ValueError:
            pass  # a colon that belongs to the path
    return text, 1.0


def add_generate(sub: Any) -> None:
    from engine.decode.draft_depth import draft_count  # mlx-free

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("--model", required=True, help="model folder, cached Hugging Face repo id, or .gguf file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized as the tokenizer's settings say)")
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated token ids, fed as they are")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as one user message")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--memory-budget", type=memory_bytes, help="e.g. 12GB or a number of bytes")
    add_kv_arguments(p)
    add_paged_arguments(p)
    add_resident_experts(p)
    from engine.cli.shard_command import add_shard_arguments

    add_shard_arguments(p)
    p.add_argument(
        "--cache-file",
        metavar="FILE.safetensors",
        help="reuse the KV cache saved in FILE when the prompt starts with its tokens "
        "(same model, adapters and template); save the new cache there",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        type=_adapter,
        metavar="DIR[:SCALE]",
        help="LoRA adapter folder (mlx-lm or PEFT), active with SCALE (default 1); repeatable",
    )
    spec = p.add_mutually_exclusive_group()
    spec.add_argument(
        "--draft-model", metavar="PATH", help="speculative decoding with this draft model (or DFlash drafter folder)"
    )
    spec.add_argument("--ngram", type=int, metavar="N", help="speculative decoding by N-gram prompt lookup")
    spec.add_argument(
        "--mtp", action="store_true", help="speculative decoding with the checkpoint's own multi-token-prediction layer"
    )
    p.add_argument(
        "--num-draft",
        type=draft_count,
        metavar="N|auto",
        help="drafts per verification pass, or auto (the default): chosen each round from the measured "
        "acceptance and pass costs, plain decoding where drafting does not pay",
    )
    p.add_argument(
        "--image", action=_MediaFlag, default=[], metavar="FILE", help="image file (repeatable; needs --chat)"
    )
    p.add_argument(
        "--thinking",
        choices=["on", "off", "low", "medium", "high"],
        help="the chat template's reasoning switch: on/off (Qwen3, DeepSeek, SmolLM3) or an "
        "effort (gpt-oss); default: the template's own",
    )
    p.add_argument(
        "--pan-and-scan",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Gemma 3: also show the model square crops of wide or tall images "
        "(default: what the model folder says, usually off)",
    )
    p.add_argument(
        "--audio",
        action=_MediaFlag,
        default=[],
        metavar="FILE",
        help="audio file (repeatable; needs --chat): heard by audio models such as Qwen2-Audio, "
        "transcribed first with --whisper for any other model",
    )
    p.add_argument(
        "--video",
        action=_MediaFlag,
        default=[],
        metavar="FILE",
        help="video file (repeatable; needs --chat): watched by video models such as Qwen3-VL "
        "(frames sampled as the model's processor does)",
    )
    p.add_argument(
        "--whisper",
        metavar="PATH",
        help="Whisper model folder or cached repo id (e.g. openai/whisper-tiny) that transcribes "
        "--audio for models without audio input (default: $MLX_DESK_WHISPER)",
    )


def _params(args: argparse.Namespace) -> Any:
    from engine.api import GenerationParams, SamplingParams
    from engine.decode.sampling import validate_sampling

    if args.max_tokens < 1:
        raise CliError(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    sampling = SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    validate_sampling(sampling)
    params = GenerationParams(
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop_strings=list(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        pan_and_scan=args.pan_and_scan,
        reasoning={"on": True, "off": False}.get(args.thinking, args.thinking),
    )
    if args.ngram is not None:
        if not 1 <= args.ngram <= MAX_NGRAM:
            raise CliError(f"--ngram must be at least 1 and at most {MAX_NGRAM} (got {args.ngram})")
        params.speculative, params.ngram_size = "ngram", args.ngram
    elif args.draft_model is not None:
        params.speculative = "draft"
    elif args.mtp:
        params.speculative = "mtp"
    if args.num_draft is not None:
        if params.speculative is None:
            raise CliError("--num-draft needs --draft-model, --ngram or --mtp")
        if args.num_draft != "auto" and not 1 <= args.num_draft <= MAX_DRAFTS:
            raise CliError(f"--num-draft must be at least 1 and at most {MAX_DRAFTS} (got {args.num_draft})")
        params.num_draft_tokens = None if args.num_draft == "auto" else args.num_draft
    return params


def _mount_adapters(host: Any, adapters: list[tuple[str, float]]) -> None:
    """Mount every --adapter and make them all active with their scales."""
    from pathlib import Path

    scales: dict[str, float] = {}
    for folder, scale in adapters:
        base = Path(folder).expanduser().resolve().name or "adapter"
        name, n = base, 1
        while name in scales:  # two folders of one name (e.g. both "adapters")
            n += 1
            name = f"{base}-{n}"
        host.mount_adapter(folder, name)
        scales[name] = scale
    if scales:
        host.set_active_adapters(scales)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.api import ProgressEvent, TokenEvent
    from engine.runtime.host import ModelHost

    if args.system is not None and not args.chat:
        raise CliError("--system needs --chat (it is a chat template message)")
    if args.chat and args.prompt is None:
        raise CliError("--chat needs --prompt TEXT (not --prompt-ids)")
    if args.audio and args.prompt is None:
        raise CliError("--audio needs --prompt TEXT (not --prompt-ids)")
    if (args.image or args.audio or args.video) and not args.chat:
        raise CliError("--image, --audio and --video need --chat (the chat template places the media)")
    from engine.decode.guards import check_utf8

    for flag, text in (("--prompt", args.prompt), ("--system", args.system), *(("--stop", s) for s in args.stop)):
        check_utf8(text, flag)
    if args.thinking is not None and not args.chat:
        raise CliError("--thinking needs --chat (it is the chat template's reasoning switch)")
    if args.pan_and_scan and not args.image:
        raise CliError("--pan-and-scan needs --image (it crops images)")
    params = _params(args)
    if args.hosts or args.shard:
        if not args.hosts:
            raise CliError("--shard needs --hosts H1,H2[,...] (the machines to split the model across)")
        from engine.cli.shard_command import generate

        return generate(args, params)
    media = _media(args)
    host = ModelHost()
    host.load(
        args.model,
        budget=args.memory_budget,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        context_cap=args.context_length,
        resident_experts=args.resident_experts,
        paged_kv_block_size=paged_block_size(args),
        paged_kv_where_possible=paged_where_possible(args),
    )
    _mount_adapters(host, args.adapter)
    if args.draft_model is not None:
        host.load_draft(args.draft_model)
    if args.audio:
        args.prompt, media = _audio_prompt(args, host, media)

    def show(event: Any) -> None:
        if not args.json and isinstance(event, TokenEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, ProgressEvent) and event.stage == "load" and event.done == 0:
            print(event.message, file=sys.stderr, flush=True)  # weights read mid-request (the MTP layer)

    if args.cache_file is not None:
        _check_cache_file(args.cache_file)
        host.restore_session("", args.cache_file)
    cancel = threading.Event()
    try:
        if args.chat:
            messages = []
            if args.system is not None:
                messages.append({"role": "system", "content": args.system})
            messages.append(user_message(args.prompt, media))
            result = host.generate("", messages, params, show, cancel, media=media)
        else:
            ids = args.prompt_ids if args.prompt_ids is not None else host.encode_prompt(args.prompt)
            if not ids:
                raise CliError("The prompt has no tokens (this tokenizer adds no BOS): give some text or --prompt-ids.")
            vocab = _vocab_size(host)
            if vocab and max(ids) >= vocab:
                raise CliError(f"--prompt-ids has id {max(ids)}, past the model's vocabulary of {vocab}")
            result = host.generate_ids(ids, params, show, cancel)
    except KeyboardInterrupt:
        cancel.set()
        raise
    if args.cache_file is not None:
        host.save_session("", args.cache_file)
    for note in result.notes:  # how the media was taken (a long video sampled, audio cut)
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        stats = result.stats
        out = {
            "text": result.text,
            "token_ids": result.token_ids,
            "token_logprobs": result.token_logprobs,
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "finish_reason": result.finish_reason,
            "prompt_tps": stats.prompt_tps,
            "generation_tps": stats.generation_tps,
            "peak_memory_bytes": stats.peak_memory_bytes,
        }
        if args.cache_file is not None:
            out["cached_tokens"] = stats.cached_tokens
            if (choice := host.session("").reopen_choice) is not None:
                out["reopen"] = choice.as_dict()  # read the saved cache, or recompute
        if (experts := json_experts(host)) is not None:
            out["experts"] = experts
        if result.notes:
            out["notes"] = result.notes
        if result.denoising_steps is not None:  # block diffusion
            out["denoising_steps"] = result.denoising_steps
            out["denoising_steps_per_block"] = result.denoising_steps_per_block
        if params.speculative is not None:
            out["draft_tokens"] = stats.draft_tokens
            out["accepted_draft_tokens"] = stats.accepted_draft_tokens
            out["acceptance_rate"] = stats.acceptance_rate
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def _check_cache_file(path: str) -> None:
    """Refuse a --cache-file that can never be written, before the prompt runs."""
    from pathlib import Path

    target = Path(path)
    if target.suffix != ".safetensors":
        raise CliError(f"--cache-file must end in .safetensors (got {path})")
    if target.is_dir():
        raise CliError(f"--cache-file {path} is a folder; give a file name")
    if not target.parent.exists():
        raise CliError(f"--cache-file: the folder {target.parent} does not exist")
    if target.is_file() and _is_other_safetensors(target):
        raise CliError(
            f"--cache-file {path} holds tensors that are not a saved KV cache (model or adapter weights?); "
            "it is left as it is: give a new file name"
        )


def _is_other_safetensors(path: Any) -> bool:
    """A readable safetensors file whose header does not name the engine's cache format:
    weights that a save would overwrite. A damaged cache reads as False, so it is replaced
    as before."""
    import struct

    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(length, 100 * 1024 * 1024)))
    except (OSError, ValueError, struct.error):
        return False
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    # models.kv_cache writes format "mlx-desk-prompt-cache/N" into every cache it saves.
    ours = isinstance(metadata, dict) and str(metadata.get("format", "")).startswith("mlx-desk-prompt-cache")
    return isinstance(header, dict) and not ours


def _media(args: argparse.Namespace) -> list[Any]:
    """--image/--audio/--video files: images, then audio, then video, each kind in the
    order given on the command line (DESIGN.md's order of a user message's parts)."""
    from engine.api import MediaInput

    order = getattr(args, "media_order", None) or []
    return [MediaInput(kind, path) for kind in ("image", "audio", "video") for k, path in order if k == kind]


class _MediaFlag(argparse.Action):
    """Appends like action="append" and also records (kind, file) in command-line order."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.append(values)
        setattr(namespace, self.dest, items)
        order = list(getattr(namespace, "media_order", None) or [])
        order.append((self.dest, values))
        namespace.media_order = order


def user_message(text: str, media: list[Any]) -> dict[str, Any]:
    from engine.media.parts import user_message as build

    return build(text, media)


def _audio_prompt(args: argparse.Namespace, host: Any, media: list[Any]) -> tuple[str, list[Any]]:
    """(prompt text, media for the user message) once --audio is settled.

    A model that hears audio (Qwen2-Audio) gets the clips themselves as audio parts. For
    any other model each clip is transcribed by the Whisper model from --whisper or
    $MLX_DESK_WHISPER, and the transcripts go before the prompt as text; without one the
    command stops and says what to pass."""
    import os

    from engine.media.whisper.transcribe import WHISPER_ENV, NoWhisperModel, no_whisper_message

    if host.info.audio:
        return args.prompt, media
    whisper = args.whisper or os.environ.get(WHISPER_ENV)
    if not whisper:
        raise NoWhisperModel(no_whisper_message(f"{host.info.name} cannot take audio"))
    transcriber = host.transcriber(whisper)
    texts = [transcriber.transcribe(m.source).text for m in media if m.kind == "audio"]
    return "\n\n".join([*texts, args.prompt]), [m for m in media if m.kind != "audio"]


def _vocab_size(host: Any) -> int:
    args = getattr(host.model, "args", None)
    return int(getattr(args, "vocab_size", 0) or 0)
