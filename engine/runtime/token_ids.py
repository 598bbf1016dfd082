"""Token ids that come from outside (a prompt given as ids, ids to embed, ids to score) are
checked here before they reach MLX: MLX reads an embedding row without a bounds check, so
an id past the table reads garbage (one answer) or crashes the process (the batched step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidTokenIds


def vocab_size(model: Any) -> int:
    """Rows of the model's token embedding (its config's vocab_size); 0 when unknown."""
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", 0) or 0)


def check_token_ids(ids: Sequence[Any], vocab: int) -> list[int]:
    """``ids`` as a list of ints, each naming a row of a ``vocab``-row embedding."""
    out: list[int] = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (vocab and i >= vocab):
            shown = i if isinstance(i, int) and not isinstance(i, bool) else repr(i)
            raise InvalidTokenIds(
                f"Token id {shown} is outside this model's vocabulary (0 to {vocab - 1})."
                if vocab
                else f"Token id {shown} is not a non-negative integer."
            )
        out.append(i)
    if not out:
        raise InvalidTokenIds("The prompt holds no token ids; give at least one.")
    return out
