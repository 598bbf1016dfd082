"""``--resident-experts``: the share of an MoE model's experts kept in memory."""

from __future__ import annotations

import argparse
from typing import Any


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--resident-experts takes a fraction such as 0.5, not {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--resident-experts must be above 0 and at most 1 (got {text})")
    return value


def fractions(text: str) -> list[float]:
    """``1,0.5,0.25``: a bench run at each."""
    return [fraction(part) for part in text.split(",") if part.strip()]


def add_resident_experts(p: argparse.ArgumentParser, many: bool = False) -> None:
    p.add_argument(
        "--resident-experts",
        type=fractions if many else fraction,
        metavar="F[,F...]" if many else "F",
        help="keep about F of an MoE model's expert weights in memory and read the others from the "
        "checkpoint when routed (default: all that the memory budget holds)"
        + ("; a comma-separated list benches each" if many else ""),
    )
    if many:
        p.add_argument(
            "--checkpoint-dir",
            metavar="DIR",
            help="with --resident-experts: write the shape's random checkpoint in DIR and keep it, or "
            "reuse the one a run with the same shape, bits, mode and seed left there (a 20 GB shape "
            "takes minutes to write)",
        )


def json_experts(host: Any) -> dict[str, Any] | None:
    """``--json``'s ``experts`` for the loaded model (None for a dense one)."""
    from engine.runtime.expert_plan import expert_report

    return expert_report(host.model, host.info.plan)
