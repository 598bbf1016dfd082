"""``python -m engine decide``: the probability of each candidate answer after a prompt.

    python -m engine decide --model PATH (--prompt TEXT [--chat] | --prompt-ids 1,2,3)
        (--candidate TEXT ... | --candidate-ids "1,2;3;4,5") [--image FILE ...] [--audio FILE ...] [--json]

Prints one line per candidate (probability, log-probability, the candidate), or with
``--json`` one object as the last line: ``candidates``, ``logprobs``, ``probabilities``
(and ``candidate_ids``, ``prompt_tokens``). Bad input ends with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.errors import EngineError


class DecideError(EngineError):
    """A decide command line that cannot be carried out as written."""


def _prompt_ids(text: str) -> list[int]:
    ids = _candidate_ids(text)
    if len(ids) != 1:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, like 1,2,3 (got {text!r})")
    return ids[0]


def _candidate_ids(text: str) -> list[list[int]]:
    """``"1,2;3;4,5"``: candidates split by ``;``, each a comma-separated list of ids."""
    out = []
    for part in text.split(";"):
        part = part.replace(" ", "")
        try:
            out.append([int(i) for i in part.split(",") if i != ""])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f'--candidate-ids takes id lists split by ";", like "1,2;3;4,5" (got {text!r})'
            ) from None
    if any(i < 0 for ids in out for i in ids):
        raise argparse.ArgumentTypeError("--candidate-ids must not be negative")
    return out


def add_decide(sub: Any) -> None:
    p = sub.add_parser("decide", help="score candidate answers after a prompt")
    p.add_argument("--model", required=True, help="model folder, cached Hugging Face repo id, or .gguf file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_prompt_ids, help="prompt token ids, fed as they are")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as one user message")
    cands = p.add_mutually_exclusive_group()  # none given: refused with one line, below
    cands.add_argument("--candidate", action="append", help="a candidate answer (repeat for each)")
    cands.add_argument("--candidate-ids", type=_candidate_ids, help='candidates as token ids: "1,2;3;4,5"')
    p.add_argument("--image", action="append", default=[], help="an image for the prompt (needs --chat)")
    p.add_argument("--audio", action="append", default=[], help="an audio clip for the prompt (needs --chat)")
    p.add_argument("--adapter", action="append", default=[], help="a LoRA adapter folder to apply (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def cmd_decide(args: argparse.Namespace) -> int:
    from engine.api import Decide, MediaInput
    from engine.decode.guards import check_utf8
    from engine.media.parts import user_message
    from engine.runtime.decide import decide
    from engine.runtime.host import ModelHost

    if args.chat and args.prompt is None:
        raise DecideError("--chat needs --prompt TEXT (not --prompt-ids)")
    # A user message's parts: images, then audio, each in the order given (DESIGN.md).
    media = [MediaInput("image", f) for f in args.image] + [MediaInput("audio", f) for f in args.audio]
    if media and not args.chat:
        raise DecideError("--image and --audio need --chat (the chat template places the media)")
    if args.candidate is None and args.candidate_ids is None:
        raise DecideError('No candidates to score: give --candidate TEXT (repeat it) or --candidate-ids "1,2;3".')
    candidates: list[Any] = args.candidate if args.candidate is not None else args.candidate_ids
    if args.candidate is not None and args.prompt is None:
        raise DecideError("--candidate TEXT needs --prompt TEXT; with --prompt-ids give --candidate-ids")
    if args.candidate_ids is not None and args.prompt is not None:
        raise DecideError("--candidate-ids goes with --prompt-ids; with --prompt TEXT give --candidate TEXT")
    check_utf8(args.prompt, "--prompt")
    for text in args.candidate or ():
        check_utf8(text, "--candidate")
    host = ModelHost()
    host.load(args.model)
    for n, folder in enumerate(args.adapter):
        host.mount_adapter(folder, f"adapter-{n}")
    if args.adapter:
        host.set_active_adapters({f"adapter-{n}": 1.0 for n in range(len(args.adapter))})
    if args.chat:
        request = Decide(candidates=candidates, messages=[user_message(args.prompt, media)], media=media)
    else:
        request = Decide(candidates=candidates, prompt=args.prompt if args.prompt is not None else args.prompt_ids)
    result = decide(host, request)
    if args.json:
        out = {
            "candidates": result.candidates,
            "logprobs": result.logprobs,
            "probabilities": result.probabilities,
            "candidate_ids": result.candidate_ids,
            "prompt_tokens": result.prompt_tokens,
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        for text, lp, p in zip(result.candidates, result.logprobs, result.probabilities):
            sys.stdout.write(f"{p:8.4f}  {lp:10.4f}  {text}\n")
    return 0
