"""Command line: ``python -m engine {generate,template,inspect,transcribe,bench,convert,serve,decide,train}``.

The flags are a contract (DESIGN.md, "Engine CLI"). Every failure exits non-zero
with one line on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from engine.cli.common import CliError, add_kv_arguments
from engine.cli.experts import add_resident_experts
from engine.cli.generate_command import MAX_DRAFTS, MAX_NGRAM, add_generate, cmd_generate, user_message
from engine.cli.numbers import Parser, memory_bytes
from engine.cli.paged_args import add_paged_arguments, paged_block_size, paged_where_possible
from engine.errors import EngineError, backend_hint

# Importable from here as before: the generate command's public names and CliError.
__all__ = ["MAX_DRAFTS", "MAX_NGRAM", "CliError", "build_parser", "cmd_generate", "main", "user_message"]


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
    add_kv_arguments(p)
    add_resident_experts(p)


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
    add_generate(sub)
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
    add_paged_arguments(bench, by_default=False)
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


# ---- the commands (generate: engine.cli.generate_command) -----------------------------


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
    add_kv_arguments(parser)
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
    args.paged_kv_where_possible = paged_where_possible(args)
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
