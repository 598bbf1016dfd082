"""How many tokens to draft per speculative round, from what this request has measured.

Speculation pays only when the tokens a round yields cost less than as many plain steps.
With per-draft acceptance ``a`` (each draft accepted with probability ``a`` while the run
lasts, the usual model of Leviathan et al. 2023), a round of ``k`` drafts yields
``(1 - a**(k+1)) / (1 - a)`` tokens on average and costs ``round_seconds(k)`` (drafting and
the verify pass over k + 1 tokens); plain decoding costs ``plain_seconds`` a token. The best
depth maximises yield * plain_seconds / round_seconds(k); when even that is not a clear gain
(``MARGIN``), decoding goes plain and probes again now and then, at growing intervals while
probes keep failing, so the probes' cost stays within noise.

Both costs are measured, not assumed: a verify pass is nearly as cheap as a one-token step
on a GPU, where a step is bound by per-step overhead, and k + 1 times as dear on a CPU,
where it is bound by arithmetic; a draft model's steps and an MTP layer's add their own.
Measurements are host wall time with the consumer's time left out (the caller times them).
``DraftDepth`` keeps the figures and decides; ``best_depth`` is the decision alone.
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Speculate only when the model predicts at least this speed-up over plain steps: below it a
# wrong guess (noise in the timings, acceptance about to fall) costs more than it could gain.
MARGIN = 1.05
# Plain tokens before the first probe once drafting stopped paying; doubled after each probe
# that still does not pay, up to PROBE_MAX, and back to PROBE_FIRST when drafting pays again.
PROBE_FIRST = 8
PROBE_MAX = 128
# What probes may cost, beyond the plain steps they replace, as a share of the plain tokens' time.
PROBE_BUDGET = 0.03
# Plain tokens timed before the first round, to know what a round competes with (the first
# is not counted: it builds kernels on first use), and again after every RECHECK rounds in a
# row, so a plain step's cost is not judged from the start of a long reply only.
CALIBRATION = 3
RECHECK = 32
RECHECK_TOKENS = 2
# How much each round's acceptance counts against earlier rounds' (exponential forgetting:
# a reply moves from prose that drafts poorly to code or quotes that draft well).
DECAY = 0.9
# Prior pseudo-counts of accepted and rejected drafts: a guess of 1/2 that a few rounds outweigh.
PRIOR = (1.0, 1.0)
# Timings kept per depth; their median resists a slow first call (kernels built on first use).
KEPT = 8
# Auto mode drafts at most this many tokens a round unless told otherwise.
AUTO_MAX_DRAFT = 6


def _on_metal() -> bool:
    """Whether MLX runs on Metal (imported here, so this module stays importable without mlx)."""
    import mlx.core as mx

    return bool(mx.metal.is_available())


def auto_depths(k_max: int) -> tuple[int, ...]:
    """The drafts per round auto mode may choose, up to ``k_max``.

    Each depth is a verify pass of its own size, and a size runs compiled kernels built on
    first use. On Metal that takes well under a second, so every depth is open. On CUDA it
    took about 8 s a size on an H200 (48.6 s for depths 1-6), paid in the middle of a reply:
    there only powers of two, 1, 2 and 4 up to the default maximum (passes of 2, 3 and 5
    tokens). They keep the three regimes apart (drafts mostly rejected: one; about half
    accepted: two; long accepted runs: four) at half the first-use cost, and what depths
    5-6 would add over 4 is small: at acceptance 0.7 a round of 6 yields 3.06 tokens where
    4 yields 2.77 (10% more), for a verify pass that costs more too."""
    if k_max < 1:
        return ()
    if _on_metal():
        return tuple(range(1, k_max + 1))
    return tuple(2**i for i in range(k_max.bit_length()) if 2**i <= k_max)


def draft_count(text: str) -> int | str:
    """A command line's drafts per round: a whole number, or "auto"."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {text!r}") from None


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of ``k`` drafts yields on average: accepted drafts plus the target's token."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_depth(
    acceptance: float,
    plain_seconds: float,
    round_seconds: Callable[[int], float],
    k_max: int,
    margin: float = MARGIN,
    depths: Iterable[int] | None = None,
) -> int:
    """The number of drafts per round that decodes fastest, or 0 when plain steps are as fast.

    ``acceptance``: the chance that a draft is accepted (given the ones before it were);
    ``plain_seconds``: one plain decode step; ``round_seconds(k)``: drafting k tokens and
    verifying them. Speculation must beat plain by ``margin`` to be chosen. ``depths``: the
    candidates (default every depth from 1 to ``k_max``)."""
    if plain_seconds <= 0 or k_max < 1:
        return 0
    best, best_speedup = 0, margin
    for k in range(1, k_max + 1) if depths is None else sorted(d for d in depths if 1 <= d <= k_max):
        cost = round_seconds(k)
        if cost <= 0:
            continue
        speedup = expected_tokens(acceptance, k) * plain_seconds / cost
        if speedup > best_speedup:
            best, best_speedup = k, speedup
    return best


@dataclass
class Spent:
    """Where a request's decoding went, as the speculative loop measured it (host wall time,
    the consumer's share left out), so a bench can say where the time goes. The first token
    (right after the prefill) is apart; ``first_use`` rounds (a verify or draft pass of a size
    never run before: compiled on first use) are among the rounds, and the one-off prefill of
    the ids a draft model had not seen among the catching up."""

    first_token_seconds: float = 0.0
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    rounds: int = 0
    round_tokens: int = 0  # what the rounds yielded: accepted drafts and the target's token
    round_seconds: float = 0.0
    catch_ups: int = 0
    catch_up_ids: int = 0
    catch_up_seconds: float = 0.0
    first_uses: int = 0
    first_use_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """Everything measured after the first token."""
        return self.plain_seconds + self.round_seconds + self.catch_up_seconds


class FixedDepth:
    """Always ``k`` drafts a round (the user chose a number)."""

    def __init__(self, k: int):
        self.k_max = max(0, k)

    def next(self, room: int) -> int:
        return max(0, min(self.k_max, room))

    def plain(self, seconds: float) -> None:
        pass

    def round(self, drafted: int, accepted: int, seconds: float, fresh: bool = False) -> None:
        pass

    def overhead(self, seconds: float, ids: int | None = None) -> None:
        pass


class DraftDepth:
    """Chooses each round's drafts from this request's measurements (see the module doc).

    The speculative loop asks ``next(room)`` before each round or plain token (0: decode a plain
    token) and reports what it measured: ``plain(seconds)`` per plain token, ``round(drafted,
    accepted, seconds, fresh)`` per verified round (``fresh``: it ran a pass of a size never run
    before, whose compiling on first use says nothing about later rounds' cost),
    ``overhead(seconds, ids)`` for a drafter's catching up on ``ids`` it had not seen before a
    round (a draft model feeding the prompt, then the ids decoded plainly). ``chosen`` records
    every non-zero answer, ``spent`` where the time went (tests and benches read them).

    Probes are budgeted: what they cost beyond the plain steps they replace (their catching up
    included) stays within ``PROBE_BUDGET`` of the time spent on plain tokens, the first round
    too. A draft model must first catch up on the whole prompt: ``watch_catch_up`` tells how
    far behind the drafter is and what an id may cost it (the target's own prefill, scaled to
    the draft's size), so a first round whose prefill would cost more than the budget waits
    until the plain tokens' time covers it (a model drafting for itself never catches up in a
    short reply: it could not pay anyway). After that, catching up costs what it measured per
    id: a draft model on a CPU, whose catching up after n plain tokens costs about n/3 steps,
    probes rarely; on a GPU, where that prefill is cheap, the doubling intervals rule.

    ``depths`` are the drafts per round it may choose (default ``auto_depths(k_max)``: fewer
    sizes of verify pass where each one's kernels are built slowly on first use)."""

    def __init__(self, k_max: int = AUTO_MAX_DRAFT, depths: Iterable[int] | None = None):
        self.k_max = max(0, k_max)
        self.depths = auto_depths(self.k_max) if depths is None else tuple(sorted(set(depths)))
        self.plain_times: deque[float] = deque(maxlen=2 * KEPT)
        self.round_times: dict[int, deque[float]] = {}
        self.accepted, self.rejected = PRIOR
        self.plain_left = CALIBRATION  # plain tokens to go before drafting is considered again
        self.probe_gap = PROBE_FIRST
        self.probe_due = False
        self.probing = False  # the round being asked for is a probe
        self.plain_total = 0.0  # seconds of plain tokens in this request
        self.since_round = 0  # plain tokens since the last round
        self.pending_overhead = 0.0  # catching up before the coming round
        self.pending_ids = 0  # the ids it fed
        self.probe_spent = 0.0  # what probes cost beyond the plain steps they replaced
        # The last probe's cost beyond the plain steps it replaced, and its catching up per
        # id it fed (a draft model's prefill; none for n-gram or MTP drafting).
        self.last_probe: tuple[float, float] | None = None
        # How many ids the drafter has not seen (None: it follows by itself), and a guess of
        # what catching up costs an id until one is measured (``watch_catch_up``).
        self.behind: Callable[[], int] | None = None
        self.catch_up_guess: float | None = None
        self.catch_up_rate: float | None = None  # seconds per id, as last measured
        self.warmed = False  # a plain token has been decoded (the first is not timed)
        self.rounds_in_a_row = 0
        self.chosen: list[int] = []
        self.spent = Spent()

    def watch_catch_up(self, behind: Callable[[], int], seconds_per_id: float | None) -> None:
        """The drafter must be fed the ids it has not seen (``behind()`` of them) before it
        drafts; ``seconds_per_id`` guesses what each costs (None: unknown)."""
        self.behind, self.catch_up_guess = behind, seconds_per_id

    # -- what was measured ------------------------------------------------------------------

    def plain(self, seconds: float) -> None:
        self.plain_total += seconds
        self.since_round += 1
        self.rounds_in_a_row = 0
        if self.warmed:
            self.plain_times.append(seconds)
            self.spent.plain_tokens += 1
            self.spent.plain_seconds += seconds
        else:
            self.spent.first_token_seconds += seconds
        self.warmed = True

    def overhead(self, seconds: float, ids: int | None = None) -> None:
        """Catching up before the coming round: ``ids`` fed (default: the plain tokens since the
        last round) in ``seconds``."""
        ids = self.since_round if ids is None else ids
        self.pending_overhead += seconds
        self.pending_ids += ids
        self.spent.catch_ups += 1
        self.spent.catch_up_ids += ids
        self.spent.catch_up_seconds += seconds

    def round(self, drafted: int, accepted: int, seconds: float, fresh: bool = False) -> None:
        if drafted <= 0:
            return
        if self.pending_ids:  # a prefill of that many ids: its rate holds for the next ones
            self.catch_up_rate = self.pending_overhead / self.pending_ids
        spent = self.spent
        spent.rounds += 1
        spent.round_tokens += accepted + 1
        spent.round_seconds += seconds
        if fresh:
            spent.first_uses += 1
            spent.first_use_seconds += seconds
        if self.probing:
            plain = self.plain_seconds() or 0.0
            # A fresh round's compiling is paid once per process, not per probe.
            excess = 0.0 if fresh else max(0.0, seconds - (accepted + 1) * plain)
            self.probe_spent += self.pending_overhead + excess
            self.last_probe = (excess, self._per_id() or 0.0)
        self.probing, self.pending_overhead, self.pending_ids, self.since_round = False, 0.0, 0, 0
        self.rounds_in_a_row += 1
        if not fresh:
            self.round_times.setdefault(drafted, deque(maxlen=KEPT)).append(seconds)
        # A run of accepted drafts, then a rejection unless all were accepted.
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted else 0.0)

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def plain_seconds(self) -> float | None:
        return statistics.median(self.plain_times) if self.plain_times else None

    def round_seconds(self, k: int) -> float:
        """Measured at k when it has been; else a line through the plain step's cost and the
        per-draft cost the measured depths show."""
        seen = self.round_times.get(k)
        if seen:
            return statistics.median(seen)
        base = self.plain_seconds() or 0.0
        per_draft = [(statistics.median(t) - base) / d for d, t in self.round_times.items() if t]
        return base + k * max(0.0, statistics.median(per_draft)) if per_draft else 0.0

    # -- the decision -------------------------------------------------------------------------

    def next(self, room: int) -> int:
        """Drafts for the next round (at most ``room``), or 0 for a plain token."""
        k = self._decide(room)
        if k:
            self.chosen.append(k)
        return k

    def _decide(self, room: int) -> int:
        self.probing = False
        if room <= 0 or self.k_max < 1:
            return 0
        if self.plain_left > 0:
            self.plain_left -= 1
            return 0
        plain = self.plain_seconds()
        if plain is None:  # nothing to compare a round with yet
            self.plain_left = CALIBRATION - 1
            return 0
        if not self.round_times:
            # A first round, of one draft (the cheapest where drafting turns out not to pay), to
            # measure a round's cost; deeper rounds' costs are extrapolated from it until measured.
            # Like a probe, what it costs beyond plain steps counts against the probe budget.
            if not self._can_afford_probe():
                self.plain_left = PROBE_FIRST - 1
                return 0
            self.probing = True
            return 1
        if self.probe_due:  # one round at the best depth, gain or not, to measure afresh
            if not self._can_afford_probe():
                self.plain_left = self.probe_gap - 1
                return 0
            self.probe_due, self.probing = False, True
            best = best_depth(self.acceptance, plain, self.round_seconds, self.k_max, 0.0, self.depths)
            return self._fit(max(1, best), room)
        if self.rounds_in_a_row >= RECHECK:  # time a few plain tokens again
            self.rounds_in_a_row = 0
            self.plain_left = RECHECK_TOKENS - 1
            return 0
        k = best_depth(self.acceptance, plain, self.round_seconds, self.k_max, depths=self.depths)
        if k == 0:
            # Plain until the next probe; each probe that finds no gain waits twice as long.
            self.plain_left = self.probe_gap - 1
            self.probe_gap = min(2 * self.probe_gap, PROBE_MAX)
            self.probe_due = True
            return 0
        self.probe_gap = PROBE_FIRST
        return self._fit(k, room)

    def _fit(self, k: int, room: int) -> int:
        """The deepest allowed depth up to ``k`` that fits ``room`` (near a reply's end a
        smaller one, never a size of pass the allowed depths would not run)."""
        fits = [d for d in self.depths if d <= min(k, room)]
        return fits[-1] if fits else min(k, room)

    def _can_afford_probe(self) -> bool:
        """Whether a probe now keeps all probes' cost within PROBE_BUDGET of the plain time,
        guessing its cost from the last probe's: the round's excess, and catching up on the
        ids the drafter has not seen (the plain tokens since the last round, unless told) at
        the last probe's rate per id, or at the guessed rate before any was measured."""
        per_id = self._per_id()
        if self.last_probe is None and (per_id is None or self.behind is None):
            return True  # nothing to guess from: the first round measures
        excess = self.last_probe[0] if self.last_probe is not None else 0.0
        behind = self.behind() if self.behind is not None else self.since_round
        predicted = excess + (per_id or 0.0) * behind
        return self.probe_spent + predicted <= PROBE_BUDGET * self.plain_total

    def _per_id(self) -> float | None:
        """What catching up costs an id: as last measured, else as guessed."""
        return self.catch_up_rate if self.catch_up_rate is not None else self.catch_up_guess
