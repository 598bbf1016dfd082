"""Adaptive draft depth: the choice from measured costs and acceptance, and the loop that
follows it.

* ``best_depth`` (the decision alone) against figures worked out by hand: a GPU-like verify
  pass that costs about a plain step, a CPU-like one that costs k + 1 steps, a draft model's
  per-draft cost, acceptance 0 and near 1, and the margin;
* ``DraftDepth`` (the controller): calibration, the first round, falling back to plain steps
  when drafting does not pay, probing at doubling intervals, resuming when it pays again;
* the speculative loop with a depth that changes every round (plain tokens included) gives
  plain greedy output token for token, for the draft-model, n-gram and MTP drafters, and
  the real controller, fed costs that turn against drafting mid-reply, drops to plain steps.
"""

from __future__ import annotations

import itertools

import pytest
from spec_models import make_llama, plain_greedy

from engine.decode import draft_depth
from engine.decode.draft_depth import (
    CALIBRATION,
    PROBE_BUDGET,
    PROBE_FIRST,
    PROBE_MAX,
    RECHECK,
    RECHECK_TOKENS,
    DraftDepth,
    best_depth,
    expected_tokens,
)
from engine.decode.drafters import DraftModelDrafter, NgramDrafter
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models.kv_cache import make_prompt_cache

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 5, 17, 3]


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_verify_as_cheap_as_a_step_drafts_deep_when_drafts_are_accepted():
    # A GPU: the verify pass of k + 1 tokens costs about one step; n-gram drafts are free.
    assert best_depth(0.9, 1.0, lambda k: 1.0 + 0.02 * k, 6) == 6
    # Nothing is ever accepted: every round yields one token at more than a step's cost.
    assert best_depth(0.0, 1.0, lambda k: 1.0 + 0.02 * k, 6) == 0


def test_verify_that_costs_k_plus_one_steps_never_pays():
    # A CPU: verification is arithmetic-bound, so k + 1 tokens cost k + 1 steps; even
    # accepting 95% of drafts cannot yield more than k + 1 tokens for that.
    assert best_depth(0.95, 1.0, lambda k: (k + 1) * 1.0, 6) == 0


def test_a_draft_model_stops_where_the_next_draft_costs_more_than_it_yields():
    # Each draft costs 0.3 of a step; acceptance 0.6. Speed-ups by hand:
    # k=1: 1.6/1.3 = 1.231; k=2: 1.96/1.6 = 1.225; k=3: 2.176/1.9 = 1.145.
    assert best_depth(0.6, 1.0, lambda k: 1.0 + 0.3 * k, 6) == 1
    # Cheaper drafts (0.1 a step): k=3: 2.176/1.3 = 1.674, k=4: 2.3056/1.4 = 1.647.
    assert best_depth(0.6, 1.0, lambda k: 1.0 + 0.1 * k, 6) == 3


def test_a_gain_below_the_margin_stays_plain():
    # k=1 at acceptance 0.1: 1.1 tokens for 1.05 steps, a 4.8% gain: under the 5% margin.
    assert best_depth(0.1, 1.0, lambda k: 1.0 + 0.05 * k, 1) == 0
    assert best_depth(0.1, 1.0, lambda k: 1.0 + 0.05 * k, 1, margin=1.0) == 1


@pytest.mark.parametrize("metal", [False, True])
def test_auto_depths_are_fewer_without_metal(monkeypatch, metal):
    # Only the backend check is replaced: each verify size is compiled on first use, slowly on CUDA.
    monkeypatch.setattr(draft_depth, "_on_metal", lambda: metal)
    want = (1, 2, 3, 4, 5, 6) if metal else (1, 2, 4)
    assert draft_depth.auto_depths(6) == want
    assert DraftDepth(6).depths == want
    assert draft_depth.auto_depths(3) == ((1, 2, 3) if metal else (1, 2))
    assert draft_depth.auto_depths(0) == ()


def test_without_metal_the_controller_runs_only_the_allowed_verify_sizes(monkeypatch):
    monkeypatch.setattr(draft_depth, "_on_metal", lambda: False)
    depth = DraftDepth(6)
    # Every draft accepted on a cheap verify pass: it would draft 6 (and 3 or 5 near the end).
    answers = feed(depth, 1.0, lambda k: 1.0 + 0.02 * k, lambda k: k, 61)
    assert set(answers) <= {0, 1, 2, 4}
    assert answers.count(4) > 5
    assert best_depth(0.9, 1.0, lambda k: 1.0 + 0.02 * k, 6, depths=(1, 2, 4)) == 4


def feed(depth: DraftDepth, plain: float, round_cost, accept, tokens: int, catch_up: float = 0.0) -> list[int]:
    """Drive the controller as the loop does for ``tokens`` tokens: each answer is a plain
    token (timed ``plain``) or a round of k drafts (timed ``round_cost(k)``, ``accept(k)``
    accepted), after the drafter caught up on the plain tokens since the last round at
    ``catch_up`` seconds each. Returns the answers."""
    answers = []
    done = behind = 0
    while done < tokens:
        k = depth.next(tokens - done - 1)
        answers.append(k)
        if k == 0:
            depth.plain(plain)
            done += 1
            behind += 1
        else:
            if catch_up and behind:
                depth.overhead(catch_up * behind)
            a = accept(k)
            depth.round(k, a, round_cost(k))
            done += a + 1
            behind = 0
    return answers


def test_the_controller_calibrates_then_drafts_where_it_pays():
    depth = DraftDepth(6, depths=range(1, 7))  # every depth open, as on Metal
    answers = feed(depth, 1.0, lambda k: 1.0 + 0.02 * k, lambda k: k, 60)  # every draft accepted
    assert answers[:CALIBRATION] == [0] * CALIBRATION  # plain steps measure what a round competes with
    assert answers[CALIBRATION] == 1  # a first round of one draft, to measure a round's cost
    assert set(answers[CALIBRATION + 1 : -1]) == {6}  # then the deepest: it pays most
    assert answers[-1] == 60 - CALIBRATION - 2 - 7 * (len(answers) - CALIBRATION - 2) - 1  # what room is left
    assert depth.acceptance > 0.9


def test_the_controller_falls_back_to_plain_and_probes_at_doubling_intervals():
    depth = DraftDepth(4)
    # A cheap verify pass (a GPU), but no draft is ever accepted: drafting never pays.
    answers = feed(depth, 1.0, lambda k: 1.0 + 0.02 * k, lambda k: 0, 600)
    rounds = [i for i, k in enumerate(answers) if k]
    gaps = [b - a - 1 for a, b in itertools.pairwise(rounds)]  # plain tokens between rounds
    # Drafting goes on while the prior's optimism fades (a few rounds back to back), then:
    assert gaps[:3] == [0, 0, 0]
    gaps = [g for g in gaps if g]
    assert gaps[:5] == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST, 8 * PROBE_FIRST, PROBE_MAX]
    assert all(g == PROBE_MAX for g in gaps[4:])
    # The probes' share of the tokens stays small: at most one round per PROBE_MAX plain tokens late on.
    assert len(gaps) <= 8


@pytest.mark.parametrize("catch_up", [0.0, 0.33])
def test_probes_cost_at_most_their_budget(catch_up):
    """Verification costs k + 1 steps (a CPU) and half the drafts are accepted, so drafting
    never pays; a draft model's catching up after plain tokens costs a third of a step each
    (CPU prefill). Whatever probes cost beyond the plain steps they replace stays within the
    budget of the plain time (plus the one probe that first showed the cost)."""
    depth = DraftDepth(4)
    answers = feed(depth, 1.0, lambda k: k + 1.0, lambda k: k // 2, 2000, catch_up=catch_up)
    plain_time = answers.count(0) * 1.0
    first = depth.last_probe[0] if depth.last_probe else 0.0
    assert depth.probe_spent <= PROBE_BUDGET * plain_time + first
    rounds = sum(1 for k in answers if k)
    if catch_up:  # catching up costs a third of the run it follows: no probe can stay in budget
        assert rounds <= 3
    else:  # a probe costs a step more than plain: the budget allows one per 33 plain tokens,
        # the intervals one per PROBE_MAX
        assert 2000 / PROBE_MAX <= rounds <= 2000 * PROBE_BUDGET + 3


def test_the_controller_resumes_drafting_when_it_pays_again():
    depth = DraftDepth(4, depths=range(1, 5))
    feed(depth, 1.0, lambda k: 1.0 + 0.05 * k, lambda k: 0, 40)  # nothing accepted: plain
    assert depth.next(10) == 0
    wait = depth.plain_left  # plain tokens until the next probe
    assert wait < PROBE_MAX
    answers = feed(depth, 1.0, lambda k: 1.0 + 0.05 * k, lambda k: k, 200)  # now every draft is
    first = next(i for i, k in enumerate(answers) if k)
    assert first == wait  # the probe comes when due
    # Drafting took over: deepest rounds (the last takes what room is left), and plain tokens
    # only to time a plain step again after every RECHECK rounds in a row.
    after = answers[first + 5 : -1]  # once acceptance has climbed (1, 1, 2, 3, then 4)
    assert {k for k in after if k} == {4}
    assert after.count(0) <= RECHECK_TOKENS * (len(after) // RECHECK + 1)


# -- the loop with a changing depth ----------------------------------------------------------


class Scripted:
    """A depth that cycles through ``script`` (0: a plain token), whatever is measured."""

    def __init__(self, script):
        self.k_max = max(script)
        self.script = itertools.cycle(script)
        self.asked = []

    def next(self, room: int) -> int:
        k = min(next(self.script), max(room, 0))
        self.asked.append(k)
        return k

    def plain(self, seconds: float) -> None:
        pass

    def round(self, drafted: int, accepted: int, seconds: float, fresh: bool = False) -> None:
        pass

    def overhead(self, seconds: float, ids: int | None = None) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    return make_llama(0)


@pytest.fixture(scope="module")
def other():
    return make_llama(1)


SCRIPT = [2, 0, 0, 4, 1, 0, 3]


@pytest.mark.parametrize("drafter_kind", ["draft", "self", "ngram"])
def test_greedy_output_is_plain_at_every_depth_change(target, other, drafter_kind):
    n = 40
    want = plain_greedy(target, PROMPT, n)
    drafter = {
        "draft": lambda: DraftModelDrafter(other),
        "self": lambda: DraftModelDrafter(target),
        "ngram": lambda: NgramDrafter(n=1, max_draft=4),
    }[drafter_kind]()
    depth = Scripted(SCRIPT)
    stats = StatsCounter()
    got = [
        t
        for t, _ in speculative_step(
            PROMPT, target, make_prompt_cache(target), drafter, max_tokens=n, stats=stats, depth=depth
        )
    ]
    assert got == want
    assert {0, 1, 2, 3, 4} <= set(depth.asked)  # every depth, plain tokens included, was used
    assert stats.draft_tokens > 0


class Costed(DraftDepth):
    """The real controller, told costs from a script instead of the clock: verification is
    cheap (a GPU) for the first ``switch`` reports, then costs k + 1 steps (a busy CPU)."""

    def __init__(self, k_max: int, switch: int):
        super().__init__(k_max)
        self.reports, self.switch = 0, switch

    def plain(self, seconds: float) -> None:
        self.reports += 1
        super().plain(1.0)

    def round(self, drafted: int, accepted: int, seconds: float, fresh: bool = False) -> None:
        self.reports += 1
        cheap = self.reports <= self.switch
        super().round(drafted, accepted, 1.0 + 0.02 * drafted if cheap else drafted + 1.0)


def test_the_real_controller_changes_depth_mid_reply_and_output_stays_plain(target):
    n = 100
    want = plain_greedy(target, PROMPT, n)
    depth = Costed(4, switch=6)
    stats = StatsCounter()
    got = [
        t
        for t, _ in speculative_step(
            PROMPT, target, make_prompt_cache(target), DraftModelDrafter(target), max_tokens=n, stats=stats, depth=depth
        )
    ]
    assert got == want
    assert 4 in depth.chosen  # while verification was cheap it drafted deep
    assert depth.plain_seconds() == 1.0 and depth.next(10) == 0  # once it was dear, it went plain
    assert stats.accepted_draft_tokens == stats.draft_tokens  # self-drafting: all accepted
