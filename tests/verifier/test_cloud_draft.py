"""The verifier's own drafts (cloud_verifier.cloud_draft): prompt lookup over the session's text."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_verifier.cloud_draft import (
    CloudDraft,
    CloudDraftError,
    ngram_draft,
    parse_cloud_drafts,
    tail_draft,
)
from cloud_verifier.settings import VerifierSettings
from shared.service.config import ConfigError


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
