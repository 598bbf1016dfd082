"""What the commands share: ``CliError``, the one-line refusal of a command line, and the
flags every command that loads a model takes for its KV cache and context
(``--kv-bits``, ``--kv-group-size``, ``--context-length``).
"""

from __future__ import annotations

import argparse

from engine.errors import EngineError


class CliError(EngineError):
    """A command line that cannot be carried out as written."""


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
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
