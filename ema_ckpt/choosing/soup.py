"""Greedy soup (Wortsman et al. 2022, "Model soups", arXiv:2203.05482, Recipe 1).

Ingredients are ordered by their own held-out score, best first. The soup starts as the best
one; each next ingredient is added when the uniform mean of the soup and it scores no worse
than the soup (the paper's ≥ for accuracy: ties are taken). The soup therefore never scores
worse than its best ingredient.

Example:
    >>> scores = {("a",): 1.0, ("b",): 2.0, ("a", "b"): 0.5, ("a", "b", "c"): 0.7, ("c",): 3.0}
    >>> soup = greedy_soup(["a", "b", "c"], lambda group: scores[tuple(group)], maximize=False)
    >>> soup.members, soup.score
    (['a', 'b'], 0.5)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["SoupResult", "SoupStep", "greedy_soup"]


@dataclass(frozen=True, slots=True)
class SoupStep:
    """One try: ``added`` joined the soup (``kept``) or not, the mean scoring ``score``."""

    added: str
    score: float | None
    kept: bool


@dataclass(slots=True)
class SoupResult:
    """The soup's members (in the order they joined), its score, and every try."""

    members: list[str]
    score: float
    path: list[SoupStep] = field(default_factory=list)


def greedy_soup(ingredients: Sequence[str], score: Callable[[Sequence[str]], float | None], *,
                maximize: bool) -> SoupResult:
    """The greedy soup of ``ingredients`` (each scorable alone). ``score(group)`` scores the
    uniform mean of ``group``; None is a failed evaluation (the ingredient is not added).

    Raises:
        ValueError: no ingredient scores on its own.
    """
    scored = [(name, s) for name in ingredients if (s := score([name])) is not None]
    if not scored:
        raise ValueError("no ingredient could be scored on its own")
    # best first; ties keep the given order (the newest checkpoint first when the caller lists them so)
    ranked = sorted(scored, key=lambda item: -item[1] if maximize else item[1])
    first, best = ranked[0]
    soup = SoupResult([first], best, [SoupStep(first, best, True)])
    for name, _ in ranked[1:]:
        trial = score([*soup.members, name])
        kept = trial is not None and (trial >= soup.score if maximize else trial <= soup.score)
        soup.path.append(SoupStep(name, trial, kept))
        if kept and trial is not None:
            soup.members.append(name)
            soup.score = trial
    return soup
