"""bench.lib.sim: the discrete-event simulation of wanspec and its baselines, on synthetic traces
whose outcome is known (timing formulas, acceptance, pre-drafting, batching)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict

import pytest

from bench.lib.costs import ROW_TOKENS
from bench.lib.prompts import Split
from bench.lib.sim import (
    PREDRAFT_BRANCHES,
    CloudDraftKind,
    Costs,
    Kind,
    Link,
    Reply,
    Request,
    SimMode,
    simulate,
)
from bench.lib.traces import Trace

pytestmark = pytest.mark.fast

P = 12  # prompt tokens
FAST = 1e15  # a link bandwidth that makes serialisation negligible (exact formulas)


def trace(
    n: int,
    wrong: Callable[[int], bool] = lambda j: False,
    *,
    rank: int = 1,
    path: list[int] | None = None,
    eos: bool = False,
    conf: float = 0.9,
) -> Trace:
    """A synthetic trace of ``n`` tokens: the draft's argmax is right except where ``wrong(j)``;
    there the target's token sits at ``rank`` of the draft's top-8 (``rank`` 8: absent), and
    the draft is unsure (its argmax 0.5, the next 0.4)."""
    ids = path if path is not None else [1000 + 7 * j % 500 for j in range(n)]
    top: list[tuple[int, ...]] = []
    probs: list[tuple[float, ...]] = []
    for j in range(n):
        others = [5000 + 8 * j + i for i in range(8)]
        if not wrong(j):
            top.append((ids[j], *others[:7]))
            probs.append((conf, *([(1 - conf) / 7] * 7)))
        else:
            row = others[:]
            if rank < 8:
                row[rank] = ids[j]
            top.append(tuple(row))
            probs.append((0.5, 0.4, *([0.1 / 6] * 6)))
    return Trace(
        name="synthetic/0",
        dataset="gsm8k",
        split=Split.MEASURED,
        prompt=tuple(range(1, P + 1)),
        path=tuple(ids[:n]),
        eos=eos,
        draft_top=tuple(top),
        draft_top_p=tuple(probs),
    )


def one(spec: str | SimMode, tr: Trace, n: int, link: Link, costs: Costs | None = None) -> Reply:
    costs = costs or Costs()
    mode = SimMode.parse(spec) if isinstance(spec, str) else spec
    res = simulate(mode, [[Request(tr, n)]], costs, link)
    assert len(res.replies) == 1
    return res.replies[0]


def test_forward_cost_is_the_regimes_function() -> None:
    c = Costs()
    assert c.forward_s(0) == 0.0
    assert c.forward_s(1) == pytest.approx(c.ar_s)
    assert c.forward_s(ROW_TOKENS) == pytest.approx(c.verify_s)
    assert c.forward_s(3) == pytest.approx((c.ar_s + c.verify_s) / 2)
    assert c.forward_s(45) == pytest.approx(c.verify_s * (1 + c.token_cost * 40))
    assert c.cloud_draft_s == pytest.approx(c.verify_s * c.cloud_draft_per_verify)


@pytest.mark.parametrize("rtt", [0.0, 0.1, 0.3])
def test_ar_reply_time_is_exact(rtt: float) -> None:
    n = 20
    link = Link(rtt, bandwidth_bps=1e6)
    r = one("ar", trace(40), n, link)
    c = Costs()
    up = r.uplink_bytes * 8 / link.bandwidth_bps
    down = 4 * 8 / link.bandwidth_bps
    assert r.tokens == n
    assert r.reply_s == pytest.approx(rtt + up + down + c.forward_s(P) + (n - 1) * c.ar_s)
    assert r.ttft_s == pytest.approx(rtt + up + down + c.forward_s(P))
    assert r.busy_s == pytest.approx(c.forward_s(P) + (n - 1) * c.ar_s)
    assert r.downlink_bytes == 4 * n


def saw_time(n: int, gamma: int, rtt: float, c: Costs, *, right: bool) -> tuple[int, float]:
    """Rounds and reply time of stop-and-wait by the round formula: each round drafts
    g = min(γ, room) tokens, sends them, waits RTT + the verify of its row (the prompt, or the
    last round's correction / bonus, then the drafts); all right, a round commits g + 1 (bonus),
    all wrong 1 (the correction). The draft's prefill comes before the first round."""
    t, done, k = c.draft_step_s(P), 0, 0
    while done < n:
        g = min(gamma, n - done)
        fixed = P if k == 0 else 1
        t += g * c.draft_s + rtt + c.forward_s(fixed + g)
        done += g + 1 if right else 1
        k += 1
    return k, t


@pytest.mark.parametrize("rtt", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("n", [30, 32])
def test_stop_and_wait_all_right_follows_the_round_formula(rtt: float, n: int) -> None:
    c = Costs()
    r = one("saw:4", trace(64), n, Link(rtt, FAST), c)
    rounds, t = saw_time(n, 4, rtt, c, right=True)
    assert rounds == math.ceil(n / 5)
    assert (r.tokens, r.rounds, r.rejections) == (n, rounds, 0)
    assert r.accepted == r.drafted == n - r.bonus
    assert r.reply_s == pytest.approx(t)
    assert r.cogen_tokens == 0


@pytest.mark.parametrize("rtt", [0.0, 0.2])
def test_stop_and_wait_all_wrong_commits_one_token_a_round(rtt: float) -> None:
    c = Costs()
    n = 12
    right = one("saw:4", trace(64), n, Link(rtt, FAST), c)
    wrong = one("saw:4", trace(64, lambda j: True), n, Link(rtt, FAST), c)
    rounds, t = saw_time(n, 4, rtt, c, right=False)
    assert rounds == n
    assert (wrong.tokens, wrong.rounds, wrong.rejections, wrong.accepted) == (n, n, n, 0)
    assert wrong.reply_s == pytest.approx(t)
    # Bounds: no faster than one verify and RTT per token, and slower than all right.
    assert wrong.decode_tokens_per_s <= 1 / (rtt + c.verify_s)
    assert wrong.reply_s > right.reply_s
    assert right.tokens == wrong.tokens


@pytest.mark.parametrize("rtt", [0.05, 0.1, 0.3])
def test_pipelined_beats_stop_and_wait_when_the_link_has_latency(rtt: float) -> None:
    tr = trace(64)
    saw = one("saw:4", tr, 64, Link(rtt))
    for spec in ("pipe:4x4", "pipe:4x4:nocogen", "auto"):
        pipe = one(spec, tr, 64, Link(rtt))
        assert pipe.tokens == saw.tokens == 64
        assert pipe.decode_tokens_per_s > saw.decode_tokens_per_s, spec


def test_the_reply_ends_at_the_paths_eos() -> None:
    tr = trace(20, eos=True)
    for spec in ("ar", "saw:4", "pipe:4x4", "auto:predraft", "hybrid", "cloud-sd:mixed:4"):
        assert one(spec, tr, 64, Link(0.1)).tokens == 20, spec


def test_cloud_sd_model_commits_gamma_plus_one_per_verify_when_every_draft_is_right() -> None:
    n = 31  # the prefill's bonus token, then 6 steps of 4 drafts + 1
    for gamma in (4, 6):
        mode = SimMode(Kind.CLOUD_SD, cloud_draft=CloudDraftKind.MODEL, cloud_gamma=gamma)
        steps = (n - 1) // (gamma + 1)
        r = one(mode, trace(64), steps * (gamma + 1) + 1, Link(0.1))
        assert r.cloud_drafted == r.cloud_accepted == steps * gamma
        assert r.cogen_tokens == steps * (gamma + 1)
        assert (r.rounds, r.drafted, r.proposes) == (0, 0, 0)  # the edge drafts nothing


def test_a_repetitive_text_makes_mixed_cloud_drafts_beat_model_drafts() -> None:
    # The draft model is always wrong; the text repeats a 6-token phrase (n-gram lookup wins).
    phrase = [101, 102, 103, 104, 105, 106]
    tr = trace(96, lambda j: True, path=phrase * 16, rank=8)
    mixed = one("cloud-sd:mixed:4", tr, 96, Link(0.1))
    model = one("cloud-sd:model:4", tr, 96, Link(0.1))
    assert mixed.tokens == model.tokens == 96
    assert mixed.cloud_accepted > 40
    assert model.cloud_accepted == 0
    assert mixed.reply_s < 0.6 * model.reply_s
    ngram = one("cloud-sd:ngram:4", tr, 96, Link(0.1))
    assert ngram.cloud_accepted == mixed.cloud_accepted


#: Pipelined with branches: the pipeline is full between verdicts, so the drafter has room.
PREDRAFT = SimMode(Kind.PIPELINED, predraft=PREDRAFT_BRANCHES)


@pytest.mark.parametrize("rtt", [0.1, 0.2])
def test_predraft_answers_every_rejection_whose_correction_is_the_second_choice(
    rtt: float,
) -> None:
    tr = trace(128, lambda j: j % 9 == 5, rank=1)
    r = one(PREDRAFT, tr, 128, Link(rtt))
    assert r.rejections > 8
    assert r.predraft_hits == r.rejections
    assert r.predraft_miss_alternative == r.predraft_miss_none == 0
    plain = one("pipe:4x4", tr, 128, Link(rtt))
    assert plain.predraft_hits == 0
    assert plain.rejections == r.rejections
    assert r.decode_tokens_per_s > plain.decode_tokens_per_s


def test_predraft_misses_corrections_outside_the_drafts_alternatives() -> None:
    tr = trace(128, lambda j: j % 9 == 5, rank=8)
    for mode in (PREDRAFT, SimMode.parse("auto:predraft")):
        r = one(mode, tr, 128, Link(0.1))
        assert r.rejections > 8
        assert r.predraft_hits == 0
        assert r.predraft_miss_alternative == r.rejections
        assert r.predraft_miss_none == 0


@pytest.mark.parametrize("spec", ["ar", "saw:4", "auto", "cloud-sd:mixed:4"])
def test_one_verifier_batches_users(spec: str) -> None:
    tr = trace(64, lambda j: j % 7 == 3)
    mode = SimMode.parse(spec)
    link = Link(0.1)
    solo = simulate(mode, [[Request(tr, 64)]], Costs(), link)
    many = simulate(mode, [[Request(tr, 64)] for _ in range(16)], Costs(), link, start_spread_s=0.5)
    assert len(many.replies) == 16
    assert all(r.tokens == 64 for r in many.replies)
    # Batching: 16 users cost the GPU far less than 16 times one. Where the verifier decodes
    # or drafts, each user gets less; where the edge drafts, a user is bound by its own
    # drafter and link, and the shared step (rationed: tails cut by survival) barely grows:
    # about a lone user's speed (measured 1.03x; 0.95x before rationing).
    assert solo.busy_s < many.busy_s < 0.5 * 16 * solo.busy_s
    rate = sum(r.tokens_per_s for r in many.replies) / 16
    alone = solo.replies[0].tokens_per_s
    if spec == "auto":
        assert 0.9 * alone < rate < 1.2 * alone
    else:
        assert rate < alone
    assert sum(r.busy_s for r in many.replies) == pytest.approx(many.busy_s)


def test_users_run_their_requests_one_after_another() -> None:
    tr = trace(32, lambda j: j % 5 == 2)
    res = simulate(SimMode.parse("auto"), [[Request(tr, 16)] * 3] * 2, Costs(), Link(0.05))
    for u in (0, 1):
        mine = [r for r in res.replies if r.user == u]
        assert len(mine) == 3
        for a, b in itertools.pairwise(mine):
            assert b.sent_s == pytest.approx(a.done_s)
    assert res.span_s == pytest.approx(max(r.done_s for r in res.replies))


def test_same_seed_same_result() -> None:
    tr = trace(64, lambda j: j % 6 == 4)
    users = [[Request(tr, 48)] * 2 for _ in range(4)]
    runs = [
        simulate(SimMode.parse("hybrid:predraft"), users, Costs(), Link(0.1), start_spread_s=1.0)
        for _ in range(2)
    ]
    assert [asdict(r) for r in runs[0].replies] == [asdict(r) for r in runs[1].replies]
    other = simulate(
        SimMode.parse("hybrid:predraft"), users, Costs(), Link(0.1), start_spread_s=1.0, seed=1
    )
    assert [r.sent_s for r in other.replies] != [r.sent_s for r in runs[0].replies]


SPECS = {
    "ar": "ar",
    "cloud-sd:mixed:4": "cloud-sd mixed γ=4",
    "cloud-sd:model:6": "cloud-sd model γ=6",
    "cloud-sd:ngram:8": "cloud-sd ngram γ=8",
    "saw:4": "stop-and-wait γ=4",
    "pipe:4x4": "pipelined γ=4 D=4",
    "pipe:4x2:nocogen": "pipelined γ=4 D=2 no-cogen",
    "pipe:4x4:predraft": "pipelined γ=4 D=4 predraft",
    "auto": "auto",
    "auto:predraft": "auto predraft",
    "hybrid": "hybrid",
    "hybrid:predraft": "hybrid predraft",
}


@pytest.mark.parametrize(("spec", "label"), SPECS.items())
def test_mode_specs_and_labels_round_trip(spec: str, label: str) -> None:
    mode = SimMode.parse(spec)
    assert mode.label == label
    assert mode.spec == spec
    assert SimMode.parse(label) == mode
    if spec.endswith("predraft"):
        assert mode.predraft == PREDRAFT_BRANCHES


@pytest.mark.parametrize("junk", ["", "pipe:4", "saw:x", "cloud-sd:tail:4", "auto:tree", "AR"])
def test_a_bad_mode_is_refused_naming_it_and_the_forms(junk: str) -> None:
    with pytest.raises(ValueError, match="expected one of") as e:
        SimMode.parse(junk)
    assert repr(junk) in str(e.value)


@pytest.mark.parametrize(
    "spec", ["saw:4", "pipe:4x4", "pipe:8x2:nocogen", "auto", "auto:predraft", "hybrid",
             "hybrid:predraft"],
)  # fmt: skip
def test_a_simulated_edge_is_configured_as_the_real_time_studies_configure_it(spec: str) -> None:
    from bench.lib.modes import parse_mode

    assert SimMode.parse(spec).pipeline_config() == parse_mode(spec).pipeline_config()
