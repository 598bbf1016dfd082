"""Command line: ``python -m engine {generate,template,inspect,transcribe,bench,convert,serve,decide,train}``.

The flags are a contract (DESIGN.md, "Engine CLI"). Every failure exits non-zero
with one line on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from typing import Any

from engine.cli.experts import add_resident_experts, json_experts
from engine.cli.numbers import Parser, memory_bytes
from engine.cli.paged_args import add_paged_arguments, paged_block_size
from engine.errors import EngineError, backend_hint


class CliError(EngineError):
    """A command line that cannot be carried out as written."""


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


def _add_generate(sub: Any) -> None:
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
    _add_kv_arguments(p)
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


def _add_transcribe(sub: Any) -> None:
    p = sub.add_parser("transcribe", help="speech to text with a Whisper model")
    p.add_argument("file", help="audio file (WAV; MP3, FLAC, OGG, M4A with ffmpeg)")
    p.add_argument(
        "--whisper",
        metavar="PATH",
        help="Whisper model folder or cached repo id, e.g. openai/whisper-tiny (default: $MLX_DESK_WHISPER)",
    )
    p.add_argument("--language", help="language code such as en or de (default: detected)")
    p.add_argument(
        "--timestamps",
        action="store_true",
        help="print one '[mm:ss.ss -> mm:ss.ss] text' line per segment (always timed over 30 s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _add_template(sub: Any) -> None:
    p = sub.add_parser("template", help="render a chat template")
    p.add_argument("--template", required=True, help=".jinja, chat_template.json or tokenizer_config.json")
    p.add_argument("--messages", required=True, help='JSON file: {"messages": [...], "tools": [...] | null}')
    p.add_argument("--add-generation-prompt", action="store_true")
    p.add_argument("--bos-token")
    p.add_argument("--eos-token")


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="config, family, quantization, memory plan")
    p.add_argument("path")
    p.add_argument("--memory-budget", type=memory_bytes)
    _add_kv_arguments(p)
    add_resident_experts(p)


def _add_kv_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        help="hold the KV cache quantized (default: the model's kv_config.json, else full precision)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=[32, 64, 128],
        default=64,
        help="values per quantization group of the KV cache (with --kv-bits; default 64)",
    )
    p.add_argument(
        "--context-length",
        type=_context_cap,
        metavar="TOKENS",
        help="the longest context a chat may reach (default: the model's, as far as the memory budget holds)",
    )


def _context_cap(text: str) -> int:
    try:
        tokens = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--context-length takes a number of tokens, not {text!r}") from None
    if not 16 <= tokens <= 1 << 24:
        raise argparse.ArgumentTypeError(f"--context-length must be between 16 and {1 << 24:,} tokens (got {tokens:,})")
    return tokens


def _add_convert(sub: Any) -> None:
    p = sub.add_parser("convert", help="Hugging Face folder -> MLX folder, optionally quantized")
    p.add_argument("source", help="Hugging Face model folder (or cached repo id)")
    p.add_argument("output", help="folder to write")
    p.add_argument("-q", "--quantize", action="store_true")
    p.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=4)
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m engine", description="MLX Desk engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_template(sub)
    _add_inspect(sub)
    _add_transcribe(sub)
    from engine.cli.bench import add_arguments
    from engine.cli.bench_concurrent import add_concurrent_arguments
    from engine.cli.bench_speculative import add_speculative_arguments
    from engine.cli.bench_step import add_mla_attention_argument, add_step_arguments

    bench = sub.add_parser("bench", help="speed on random weights of a real model shape")
    add_arguments(bench)
    add_speculative_arguments(bench)
    add_concurrent_arguments(bench)
    add_step_arguments(bench)
    add_mla_attention_argument(bench)
    add_paged_arguments(bench)
    from engine.cli.bench_shared import add_shared_arguments

    add_shared_arguments(bench)
    _add_convert(sub)

    _add_serve(sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server"))
    from engine.cli.decide_command import add_decide
    from engine.cli.train_command import add_train

    add_decide(sub)
    add_train(sub)
    from engine.cli.shard_command import add_node

    add_node(sub)
    return parser


# ---- generate ---------------------------------------------------------------------


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


# ---- the other commands ----------------------------------------------------------------


def cmd_template(args: argparse.Namespace) -> int:
    from engine.cli.template_command import run_template_command

    return int(
        run_template_command(
            template_path=args.template,
            messages_path=args.messages,
            add_generation_prompt=args.add_generation_prompt,
            bos_token=args.bos_token,
            eos_token=args.eos_token,
        )
        or 0
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.runtime.model_info import format_inspect, inspect_model

    kwargs = {"memory_budget": args.memory_budget} if args.memory_budget else {}
    info = inspect_model(
        args.path,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        context_cap=args.context_length,
        resident_experts=args.resident_experts,
        **kwargs,
    )
    print(format_inspect(info))
    return 0


def cmd_transcribe(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from engine.media.whisper.transcribe import WHISPER_ENV, NoWhisperModel, Transcriber, no_whisper_message

    whisper = args.whisper or os.environ.get(WHISPER_ENV)
    if not whisper:
        raise NoWhisperModel(no_whisper_message("transcribe needs a Whisper model"))
    from engine.media.audio import load_audio
    from engine.media.mel import WHISPER_SAMPLE_RATE

    samples = load_audio(args.file, WHISPER_SAMPLE_RATE)  # an unreadable file fails before any load
    transcriber = Transcriber.load(whisper)
    if transcriber.settings.sample_rate != WHISPER_SAMPLE_RATE:
        samples = load_audio(args.file, transcriber.settings.sample_rate)
    result = transcriber.transcribe(samples, language=args.language, timestamps=args.timestamps)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), ensure_ascii=False))
    elif args.timestamps:
        for seg in result.segments:
            print(f"[{_clock(seg.start_s)} -> {_clock(seg.end_s)}] {seg.text}")
    else:
        print(result.text)
    return 0


def _clock(seconds: float) -> str:
    """00:01.20, or 1:02:03.40 past an hour."""
    centis = round(max(0.0, seconds) * 100)  # round once, so 59.999 reads 01:00.00
    hours, rest = divmod(centis, 360000)
    minutes, centis = divmod(rest, 6000)
    clock = f"{minutes:02d}:{centis // 100:02d}.{centis % 100:02d}"
    return f"{hours}:{clock}" if hours else clock


def cmd_convert(args: argparse.Namespace) -> int:
    from engine.cli.convert import convert

    out = convert(
        args.source,
        args.output,
        quantize_bits=args.bits if args.quantize else None,
        group_size=args.group_size,
        dtype=args.dtype,
    )
    print(f"wrote {out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.cli.bench import run_bench
    from engine.cli.bench_concurrent import run_concurrent
    from engine.cli.bench_speculative import run_speculative
    from engine.cli.bench_step import apply_mla_attention, run_step

    apply_mla_attention(args)
    if args.step:
        return run_step(args)
    return run_bench(args, speculative=run_speculative, concurrent=run_concurrent)


def _add_serve(parser: Any) -> None:
    from engine.serve.server import DEFAULT_MAX_BODY

    parser.add_argument("--model", required=True, help="model folder, cached Hugging Face repo id, or .gguf file")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; anything else needs --api-key)",
    )
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or x-api-key) on every request")
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_BODY,
        help=f"largest request body taken (default {DEFAULT_MAX_BODY}); larger ones get 413",
    )
    parser.add_argument("--memory-budget", type=memory_bytes, help="e.g. 12GB or a number of bytes")
    _add_kv_arguments(parser)
    add_paged_arguments(parser)
    add_resident_experts(parser)
    from engine.cli.shard_command import add_shard_arguments

    add_shard_arguments(parser)


def cmd_node(args: argparse.Namespace) -> int:
    from engine.cli.shard_command import cmd_node as run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.serve.server import run_command

    if args.hosts or args.shard:
        if not args.hosts:
            raise CliError("--shard needs --hosts H1,H2[,...] (the machines to split the model across)")
        from engine.cli.shard_command import serve

        return serve(args)
    args.paged_kv_block_size = paged_block_size(args)
    return run_command(args)


COMMANDS = {
    "generate": cmd_generate,
    "template": cmd_template,
    "inspect": cmd_inspect,
    "transcribe": cmd_transcribe,
    "convert": cmd_convert,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "decide": lambda args: _decide(args),
    "train": lambda args: _train(args),
    "node": cmd_node,
}


def _decide(args: argparse.Namespace) -> int:
    from engine.cli.decide_command import cmd_decide

    return cmd_decide(args)


def _train(args: argparse.Namespace) -> int:
    from engine.cli.train_command import cmd_train

    return cmd_train(args)


def _fail(message: str) -> int:
    sys.stdout.flush()
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a refused command line (one line already printed), or --help
        return e.code if isinstance(e.code, int) else 2
    try:
        return COMMANDS[args.command](args)
    except EngineError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): nothing left to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ImportError as e:
        return _fail(backend_hint(e) or f"a module the engine needs is missing: {e}")
    except Exception as e:  # noqa: BLE001 - the contract: one line, never a traceback
        from engine.runtime.readable import readable

        return _fail(readable(e))


if __name__ == "__main__":
    sys.exit(main())
