"""What a token source yields: a ``Token`` (id, log-prob or None), or a ``Signal``.

Every token source (the plain loop, a batch row, the rolling window, speculative
decoding) yields ``Token`` pairs. A batch row also yields ``Signal.WAITING`` while the
batch has no token for it yet (whoever drives the batch steps it between rounds), and
inside the batch a row whose logits were NaN or infinite is queued ``Signal.NON_FINITE``
(its sequence raises the one-line damaged-weights error when it reads it). A typed signal,
never a negative id: an id is always a real token.
"""

from __future__ import annotations

import enum
from typing import TypeAlias


class Signal(enum.Enum):
    WAITING = "waiting"  # a batched sequence waits for the batch's next step
    NON_FINITE = "non-finite"  # the row's logits were NaN or infinite (damaged weights)


Token: TypeAlias = tuple[int, float | None]
