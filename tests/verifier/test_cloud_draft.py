"""The verifier's own drafts (cloud_verifier.session.cloud_draft): prompt lookup over the session's
text,
the rejected draft's tail, and the per-session length of a model draft
(cloud_verifier.engine.draft_length)."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.engine.draft_length import draft_length, expected_tokens
from cloud_verifier.engine.step_times import DraftCost
from cloud_verifier.session.cloud_draft import (
    CloudDraft,
    CloudDraftError,
    DraftAcceptance,
    ngram_draft,
    parse_cloud_drafts,
    tail_draft,
)
from shared.service.config import ConfigError, load_settings

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("text", "max_tokens", "want"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # the 3-gram [1, 2, 3] occurred before
        ([1, 2, 3, 4, 1, 2, 3], 1, [4]),  # at most max_tokens
        ([1, 2, 3, 1], 4, [2, 3, 1]),  # only the 1-gram matches
        ([7, 7, 7], 2, [7]),  # a run: the latest occurrence, overlapping the suffix
        ([5, 6, 7], 2, []),  # no earlier occurrence
        ([1], 3, []),  # nothing before
        ([1, 2, 1, 2], 0, []),  # no room
    ],
)
def test_prompt_lookup(text: list[int], max_tokens: int, want: list[int]) -> None:
    assert ngram_draft(text, max_tokens) == want


def test_the_longest_and_latest_match_wins() -> None:
    # [8, 9] then 1 early; [9] then 2 later; the 2-gram match comes first.
    assert ngram_draft([8, 9, 1, 9, 2, 5, 8, 9], 1) == [1]
    # Two occurrences of [4, 5]: the latest one's continuation.
    assert ngram_draft([4, 5, 1, 4, 5, 2, 4, 5], 1) == [2]


def test_only_the_window_is_searched() -> None:
    text = [3, 9, *range(10, 100), 3]
    assert ngram_draft(text, 1) == [9]
    assert ngram_draft(text, 1, window=50) == []


def test_agrees_with_a_plain_search_on_random_texts() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = rng.integers(0, 5, int(rng.integers(1, 40))).tolist()
        want: list[int] = []
        for n in range(min(3, len(text) - 1), 0, -1):
            starts = [i for i in range(len(text) - n) if text[i : i + n] == text[-n:]]
            if starts:
                want = text[starts[-1] + n : starts[-1] + n + 4]
                break
        assert ngram_draft(text, 4) == want, text


def test_cloud_draft_settings_name_sources_and_bad_ones_are_refused() -> None:
    assert parse_cloud_drafts("off") == frozenset()
    assert parse_cloud_drafts("") == frozenset()
    assert parse_cloud_drafts(" tail , ngram ") == {CloudDraft.TAIL, CloudDraft.NGRAM}
    with pytest.raises(CloudDraftError, match="cloud_draft must be one of off, ngram, tail"):
        parse_cloud_drafts("ngram,eagle")
    with pytest.raises(CloudDraftError, match="'off' cannot be combined"):
        parse_cloud_drafts("off,ngram")
    with pytest.raises(ConfigError, match="setting 'cloud_draft'"):
        VerifierSettings(cloud_draft="ngarm")
    with pytest.raises(ConfigError, match=r"setting 'cloud_draft_model'.*tp = 1"):
        VerifierSettings(cloud_draft_model="self:skip=12", tp=2)


def test_a_tail_drafts_only_where_the_text_agrees_with_its_head() -> None:
    tail = (3, [7, 8, 9])  # drafted for positions 3, 4, 5
    assert tail_draft(tail, [1, 2, 4], 2) == [7, 8]  # text ends at 3: from the tail's start
    assert tail_draft(tail, [1, 2, 4, 7], 5) == [8, 9]  # one agreed: the rest
    assert tail_draft(tail, [1, 2, 4, 6], 5) == []  # the text left it
    assert tail_draft(tail, [1, 2, 4, 7, 8, 9], 5) == []  # nothing left
    assert tail_draft(tail, [1, 2], 5) == []  # the text does not reach it
    assert tail_draft(None, [1, 2], 5) == [] and tail_draft(tail, [1, 2, 4], 0) == []


def _walltime_factor(alpha: float, gamma: int, cost: float) -> float:
    """Leviathan et al., Theorem 3.8, summed term by term (no closed form): the expected tokens
    of a γ-token draft, Σ_{i=0..γ} α^i, over the time of γ draft forwards and one verify."""
    return sum(alpha**i for i in range(gamma + 1)) / (1 + gamma * cost)


@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.3, 0.55, 0.7, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("cost", [0.0, 0.05, 0.11, 0.3, 0.6, 1.0, 2.0])
def test_the_draft_length_maximises_the_walltime_factor(alpha: float, cost: float) -> None:
    cap = 8
    gamma = draft_length(alpha, cost, cap)
    values = [_walltime_factor(alpha, g, cost) for g in range(cap + 1)]
    assert values[gamma] == pytest.approx(max(values), rel=1e-9)
    assert expected_tokens(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)))


def test_drafting_pays_only_when_acceptance_beats_the_cost() -> None:
    # γ = 1 beats decoding one token iff α > c: (1 + α) / (1 + c) > 1.
    assert draft_length(0.10, 0.11, 8) == 0
    assert draft_length(0.12, 0.11, 8) >= 1
    assert draft_length(0.5, 0.6, 8) == 0  # a CPU-like cost: a draft forward costs 0.6 verifies
    assert draft_length(0.9, 0.0, 8) == 8  # free drafts: as long as allowed
    assert draft_length(0.9, 0.11, 3) == 3  # within the cap
    # Longer with better acceptance, shorter with dearer drafts.
    by_alpha = [draft_length(a / 20, 0.11, 16) for a in range(20)]
    assert by_alpha == sorted(by_alpha) and by_alpha[0] == 0 and by_alpha[-1] >= 8
    by_cost = [draft_length(0.8, c / 10, 16) for c in range(12)]
    assert by_cost == sorted(by_cost, reverse=True) and by_cost[-1] == 0


def test_acceptance_is_learnt_from_drafts_and_fades_back_to_the_prior() -> None:
    est = DraftAcceptance(prior=0.7, weight=1.0, decay=0.9)
    assert est.alpha == pytest.approx(0.7)  # a new session drafts
    for _ in range(20):
        est.observe(drafted=4, accepted=0)  # every draft rejected at its first token
    assert est.alpha < 0.11  # drafting stops paying even at a GPU's cost
    assert draft_length(est.alpha, 0.11, 8) == 0
    fades = 0
    while draft_length(est.alpha, 0.11, 8) == 0:
        est.fade()  # co-generations with no draft made: the old failures fade
        fades += 1
    assert 1 <= fades <= 20  # it is tried again, not written off for good
    good = DraftAcceptance()
    for _ in range(20):
        good.observe(drafted=4, accepted=4)  # all accepted: successes only
    assert good.alpha > 0.95
    mixed = DraftAcceptance(weight=0.0, decay=1.0)
    mixed.observe(drafted=4, accepted=2)  # 2 successes and a failure
    mixed.observe(drafted=4, accepted=4)  # 4 successes
    assert mixed.alpha == pytest.approx(6 / 7)


def test_the_draft_cost_is_a_ratio_of_moving_averages() -> None:
    cost = DraftCost(weight=0.5)
    assert cost.ratio == 0.0  # nothing seen: a first draft is made as asked
    cost.observe_draft(forwards=4, seconds=0.4)
    assert cost.ratio == 0.0
    cost.observe_target(1.0)
    assert cost.ratio == pytest.approx(0.1)
    cost.observe_target(0.0)  # moves halfway
    assert cost.ratio == pytest.approx(0.2)
    cost.observe_draft(forwards=0, seconds=5.0)  # no forward: nothing learnt
    assert cost.ratio == pytest.approx(0.2)


def test_the_draft_length_setting_is_checked() -> None:
    assert VerifierSettings().cloud_draft_length == "auto"
    fixed = load_settings(VerifierSettings, env={"WANSPEC_CLOUD_DRAFT_LENGTH": "fixed"})
    assert fixed.cloud_draft_length == "fixed"
    with pytest.raises(ConfigError, match="cloud_draft_length"):
        load_settings(VerifierSettings, env={"WANSPEC_CLOUD_DRAFT_LENGTH": "sometimes"})
