"""What the adaptive draft depth charges a probe, and where a request's time is said to go.

* A draft model's first round feeds it the whole prompt: that round waits until the plain
  tokens' time covers it within the probe budget (a model drafting for itself never, in a
  reply shorter than a few thousand tokens), and catching up is priced per id fed;
* a round that ran a pass of a size never run before (traced, on a GPU compiled, on first
  use) counts toward acceptance but not toward what rounds cost;
* ``spent`` adds up plain tokens, rounds and catching up as the loop reported them;
* the speculative loop tells the depth how far behind a draft model is, guesses its cost
  per id from the target's prefill, and marks the rounds that traced a new pass size.
"""

from __future__ import annotations

import itertools

import pytest
from spec_models import make_llama, plain_greedy

from engine.decode.draft_depth import CALIBRATION, PROBE_BUDGET, PROBE_FIRST, DraftDepth
from engine.decode.drafters import DraftModelDrafter
from engine.decode.speculative import speculative_step
from engine.models.kv_cache import make_prompt_cache


def drive(
    depth: DraftDepth, tokens: int, *, prompt: int, per_id: float, guess: float | None, accept, fed: list | None = None
) -> list[int]:
    """Drive the controller as the loop does with a draft model that has seen none of a
    ``prompt``-id prompt: plain tokens cost 1.0, a round of k drafts 1.0 + 0.02 k (a GPU)
    with ``accept(k)`` accepted, and before a round the drafter catches up on every id it has
    not seen at ``per_id`` each (their counts go to ``fed``). Returns the answers."""
    behind = [prompt]
    depth.watch_catch_up(lambda: behind[0], guess)
    answers, done = [], 0
    fed = [] if fed is None else fed
    while done < tokens:
        k = depth.next(tokens - done - 1)
        answers.append(k)
        if k == 0:
            depth.plain(1.0)
            done += 1
            behind[0] += 1
            continue
        depth.overhead(per_id * behind[0], behind[0])
        fed.append(behind[0])
        a = accept(k)
        depth.round(k, a, 1.0 + 0.02 * k)
        done += a + 1
        behind[0] = 1  # the target's token after the accepted drafts
    return answers


def test_drafting_for_itself_never_pays_for_the_prompt_prefill():
    # The target's own prefill costs a tenth of a step per id: catching up on a 500-id prompt
    # costs 50 steps, more than the budget's share of any reply shorter than ~1,700 tokens.
    depth = DraftDepth(4)
    answers = drive(depth, 1000, prompt=500, per_id=0.1, guess=0.1, accept=lambda k: k)
    assert set(answers) == {0}
    assert depth.spent.catch_up_ids == 0 and depth.probe_spent == 0


def test_a_small_draft_models_first_round_comes_once_the_budget_covers_it():
    # A draft a hundredth of the target: the prompt costs it 0.5 step, paid for by 0.5 / 0.03
    # = 17 plain tokens (and the ids it falls behind meanwhile).
    per_id = 0.001
    depth = DraftDepth(4)
    answers = drive(depth, 400, prompt=500, per_id=per_id, guess=per_id, accept=lambda k: k)
    first = answers.index(1)
    assert CALIBRATION < first <= 30
    assert PROBE_BUDGET * first >= per_id * (500 + first)  # affordable when it came
    assert PROBE_BUDGET * (first - PROBE_FIRST) < per_id * (500 + first - PROBE_FIRST)  # not a gap before
    assert 4 in answers[first:]  # then, every draft accepted, drafting took over
    assert depth.spent.catch_up_ids >= 500


def test_unknown_catch_up_costs_let_the_first_round_measure_them():
    depth = DraftDepth(4)
    answers = drive(depth, 200, prompt=500, per_id=0.1, guess=None, accept=lambda k: 0)
    assert answers[CALIBRATION] == 1  # measured: 50 steps of catching up
    assert depth.last_probe is not None and depth.last_probe[1] == pytest.approx(0.1)
    # Rounds go on while the prior's optimism fades (they pay by the model, so they are not
    # probes); once plain, no probe fits the budget those 50 steps used up.
    plain_from = answers.index(0, CALIBRATION)
    assert set(answers[plain_from:]) == {0}
    assert depth.probe_spent > 50


def test_a_round_that_traced_a_new_pass_size_does_not_price_rounds():
    depth = DraftDepth(4)
    for _ in range(CALIBRATION):
        assert depth.next(100) == 0
        depth.plain(1.0)
    assert depth.next(100) == 1
    depth.round(1, 1, 40.0, fresh=True)  # 40 steps: compiling on first use
    assert not depth.round_times and depth.probe_spent == 0
    assert depth.acceptance > 0.5  # what it accepted still counts
    assert depth.next(100) == 1  # a first round again, to measure what rounds cost
    depth.round(1, 1, 1.02)
    assert depth.round_times == {1: pytest.approx([1.02])}
    assert depth.next(100) > 0  # drafting pays
    assert (depth.spent.rounds, depth.spent.first_uses, depth.spent.first_use_seconds) == (2, 1, 40.0)


def test_spent_adds_up_what_the_loop_reported():
    depth = DraftDepth(4)
    fed: list[int] = []
    answers = drive(depth, 200, prompt=40, per_id=0.01, guess=None, accept=lambda k: k // 2, fed=fed)
    spent = depth.spent
    rounds = [k for k in answers if k]
    assert spent.first_token_seconds == 1.0  # the first plain token, apart
    assert spent.plain_tokens == answers.count(0) - 1 and spent.plain_seconds == spent.plain_tokens * 1.0
    assert spent.rounds == len(rounds) and spent.round_tokens == sum(k // 2 + 1 for k in rounds)
    assert spent.round_seconds == pytest.approx(sum(1.0 + 0.02 * k for k in rounds))
    assert spent.catch_ups == len(rounds) and spent.catch_up_ids == sum(fed) >= 40 + CALIBRATION
    assert spent.catch_up_seconds == pytest.approx(0.01 * sum(fed))
    assert spent.seconds == pytest.approx(spent.plain_seconds + spent.round_seconds + spent.catch_up_seconds)


# -- the loop --------------------------------------------------------------------------------


class Recording(DraftDepth):
    """The real controller on a script of depths (0: a plain token), recording what the loop
    tells it."""

    def __init__(self, script: list[int]):
        super().__init__(max(script))
        self.script = itertools.cycle(script)
        self.watched: list[tuple[int, float | None]] = []
        self.rounds: list[tuple[int, bool]] = []

    def watch_catch_up(self, behind, seconds_per_id):
        super().watch_catch_up(behind, seconds_per_id)
        self.watched.append((behind(), seconds_per_id))

    def next(self, room: int) -> int:
        return min(next(self.script), max(room, 0))

    def round(self, drafted, accepted, seconds, fresh=False):
        super().round(drafted, accepted, seconds, fresh)
        self.rounds.append((drafted, fresh))


PROMPT = [(5 * i + 3) % 90 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def target():
    return make_llama(0)


def test_the_loop_tells_how_far_behind_a_draft_model_is(target):
    small = make_llama(1, hidden=16)
    drafter = DraftModelDrafter(small)
    assert DraftModelDrafter(target).relative_cost(target) == 1.0
    assert 0 < drafter.relative_cost(target) < 0.5  # a quarter of the weights, and the shared shapes
    depth = Recording([0, 0, 2])
    got = [
        t for t, _ in speculative_step(PROMPT, target, make_prompt_cache(target), drafter, max_tokens=12, depth=depth)
    ]
    assert got == plain_greedy(target, PROMPT, 12)
    [(behind, guess)] = depth.watched
    assert behind == len(PROMPT)  # nothing of the prompt fed to the draft model yet
    assert guess is not None and guess > 0  # the target's prefill per id, scaled to the draft
    assert depth.spent.catch_up_ids >= len(PROMPT)  # the first round fed it the prompt
    assert depth.behind is not None and depth.behind() < len(PROMPT)  # caught up since


def test_rounds_that_trace_a_new_verify_size_are_marked(target):
    """Compiled steps (a GPU's default) trace each size of pass on first use: the first round
    verifying 2 drafts and the first verifying 3 are marked, later ones of those sizes not."""
    depth = Recording([0, 2, 2, 3, 3, 0, 2])
    got = [
        t
        for t, _ in speculative_step(
            PROMPT,
            target,
            make_prompt_cache(target),
            DraftModelDrafter(target, compiled=True),
            max_tokens=24,
            depth=depth,
            compiled=True,
        )
    ]
    assert got == plain_greedy(target, PROMPT, 24)
    fresh = {k: [f for d, f in depth.rounds if d == k] for k in (2, 3)}
    assert fresh[2][0] and fresh[3][0]
    assert not any(fresh[3][1:]) and not fresh[2][-1]
    assert depth.spent.first_uses == sum(f for _, f in depth.rounds) >= 2


def test_a_probe_by_a_model_drafter_drops_no_queued_step(target, monkeypatch):
    """The depth is asked before the plain step after a token is queued: when it wants drafts
    from a model (which always has some), no step is queued that the round would drop."""
    import engine.decode.speculative as spec

    cache = make_prompt_cache(target)
    trims = []
    real = spec.trim_prompt_cache

    def trim(c, n):
        if c is cache and n:
            trims.append(n)
        return real(c, n)

    monkeypatch.setattr(spec, "trim_prompt_cache", trim)
    depth = Recording([0, 0, 0, 2])
    got = [t for t, _ in speculative_step(PROMPT, target, cache, DraftModelDrafter(target), max_tokens=30, depth=depth)]
    assert got == plain_greedy(target, PROMPT, 30)
    assert len(depth.rounds) >= 4  # probes after plain stretches
    assert depth.spent.round_tokens == 3 * len(depth.rounds)  # drafting for itself: all accepted
    assert trims == []  # nothing fed to the target was taken back
