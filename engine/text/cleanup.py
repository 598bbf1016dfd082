"""``clean_up_tokenization_spaces``: the space removal transformers applies after decoding.

A tokenizer_config.json may ask for it; transformers then removes the space before
``.``, ``?``, ``!``, ``,`` and in `` ' ``, `` n't``, `` 'm``, `` 's``, `` 've``, `` 're``,
one ``str.replace`` after another in that order. The order matters: an earlier
replacement can make a later one match (``"  ' ve"`` becomes ``" 've"``, then ``"'ve"``),
and a single pass of ``replace`` leaves some matches behind (``"  ."`` becomes ``" ."``).
So the same chain is applied here, never a regular expression that "means the same".

For streaming, ``StreamingCleanup`` emits a prefix only once no later text can change
how it is cleaned (see ``settled_length``).
"""

from __future__ import annotations

# (pattern, replacement) in the order transformers applies them.
REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)

# Per step of the chain: the beginnings of its pattern that a later text could complete.
_OPEN_ENDS = tuple(tuple(pattern[:n] for n in range(1, len(pattern))) for pattern, _ in REPLACEMENTS)


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``, replacement for replacement."""
    for pattern, replacement in REPLACEMENTS:
        text = text.replace(pattern, replacement)
    return text


def is_settled(text: str) -> bool:
    """Whether ``clean(text + more) == clean(text) + clean(more)`` for every ``more``.

    ``str.replace`` on ``a + b`` equals ``replace(a) + replace(b)`` unless some match spans
    the join, which needs ``a`` to end in a proper beginning of the pattern. Checking that
    for each step of the chain, on the text as the earlier steps left it, covers the chain.
    """
    for (pattern, replacement), open_ends in zip(REPLACEMENTS, _OPEN_ENDS):
        if text.endswith(open_ends):
            return False
        text = text.replace(pattern, replacement)
    return True


def settled_length(text: str) -> int:
    """The length of the longest prefix of ``text`` that is settled (0 always is)."""
    for end in range(len(text), 0, -1):
        # Every pattern starts with a space, so a prefix ending in one is never settled.
        if text[end - 1] != " " and is_settled(text[:end]):
            return end
    return 0


class StreamingCleanup:
    """Cleans text that arrives in pieces; the outputs join to ``clean_up_tokenization(whole)``.

    Holds back the shortest tail that later text could still change: a trailing space,
    `` n``, `` '``, and the like.
    """

    def __init__(self) -> None:
        self._pending = ""  # raw text after the last settled cut

    def push(self, text: str) -> str:
        if not text:
            return ""
        pending = self._pending + text
        cut = settled_length(pending)
        self._pending = pending[cut:]
        return clean_up_tokenization(pending[:cut])

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return clean_up_tokenization(pending)
