"""The two record types of the registry: a practice (or open question) and a paper."""

from __future__ import annotations

from dataclasses import dataclass

# Statuses a registry row may carry. "Open" is reserved for the Q-n questions, the others for SOTA ids.
PRACTICE_STATUSES = ("Active", "Proposed", "Rejected")
QUESTION_STATUS = "Open"
STATUSES = PRACTICE_STATUSES + (QUESTION_STATUS,)


@dataclass(frozen=True)
class Practice:
    """One registry row: a practice we may implement and test, or an open question we mean to measure."""

    id: str
    title: str
    status: str
    sources: tuple[str, ...]
    reason: str
    claim: str
    module: str
    experiment: str  # the bench experiment that tests the claim first (the first of `experiments`; "" for none)
    issue: int
    # every bench experiment that measures the row, `experiment` first: a practice a later bench measures too (a
    # GPU throughput run, a scale sweep, a codec's GB/s) names it here as well (registry.toml: experiment = [...])
    experiments: tuple[str, ...] = ()

    @property
    def implemented(self) -> bool:
        # Code alone is not enough: a practice counts once an experiment tests its claim too.
        return bool(self.module) and bool(self.experiment)

    @property
    def is_question(self) -> bool:
        return self.id.startswith("Q-")


@dataclass(frozen=True)
class Paper:
    """One reading-list row; `practices` are the registry ids whose sources name this paper."""

    id: str
    authors_year: str
    ref: str
    title: str
    note: str
    practices: tuple[str, ...]
