"""The length of a model draft that pays for itself: the rule behind ``cloud_draft_length =
auto`` (:class:`~cloud_verifier.session.cloud_draft.DraftLength`), which the model runner
(:mod:`cloud_verifier.engine.runner`) applies per session and step to the session's measured
acceptance α of its model drafts and the measured cost c of a draft forward
(:class:`~cloud_verifier.engine.step_times.DraftCost`).

Pure: no I/O, no torch.
"""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens per verify] of a γ-token draft whose tokens are each accepted with
    probability α, independently (Leviathan et al., eq. 1): (1 − α^(γ+1)) / (1 − α)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def draft_length(alpha: float, cost: float, cap: int) -> int:
    """The draft length γ in [0, cap] that maximises the expected tokens per unit of target
    time, ``expected_tokens(α, γ) / (1 + γ·c)``, where c (``cost``) is a draft forward's time
    relative to a target forward's (Leviathan et al., Theorem 3.8: the walltime improvement
    factor). γ = 0 (decode one token, no draft) has value 1; γ = 1 beats it iff α > c. Ties go
    to the shorter draft (less draft work for the same expectation)."""
    alpha = min(max(alpha, 0.0), 1.0)
    cost = max(cost, 0.0)
    best, best_value = 0, 1.0
    for gamma in range(1, cap + 1):
        value = expected_tokens(alpha, gamma) / (1.0 + gamma * cost)
        if value > best_value * (1.0 + 1e-9):
            best, best_value = gamma, value
    return best
