"""Profile specifications as text: σ_rel lists with EDM2 ranges, γ lists, merge weights.

The library accepts the same strings as the command line (``accumulate(..., sigma_rels=
["0.05,0.10"])``, ``posthoc(..., sigma_rels=["0.010:0.250:0.005"])``), so their parsing lives
here, beside the maths, and words its errors as ``OptionError`` on the library parameter.

Example:
    >>> parse_sigma_list("0.05,0.08:0.10:0.01")
    [('0.05', 0.05), ('0.08', 0.08), ('0.09', 0.09), ('0.10', 0.1)]
    >>> parse_gamma_list("6.94, 16.97")
    [('6.94', 6.94), ('16.97', 16.97)]
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import cast

from .errors import OptionError, UsageError
from .maths.merge_weights import NAMED_SCHEDULES, rate_schedule_weights, schedule_weights
from .maths.power import check_gamma, check_sigma_rel, sigma_rel_to_gamma

__all__ = ["MergeWeights", "parse_count_list", "parse_gamma_list", "parse_sigma_list", "parse_weights"]

_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_MAX_LIST = 10_000


def _refuse(problem: str, text: str) -> OptionError:
    return OptionError("sigma_rels", "{sigma_rels}" + problem, value=text)


def _decimal(text: str, item: str, whole: str) -> Decimal:
    if not _NUMBER.fullmatch(text):
        raise _refuse(f": {item!r} is not a number or a start:stop:step range", whole)
    return Decimal(text)


def parse_sigma_list(text: str) -> list[tuple[str, float]]:
    """Parse σ_rel values: comma lists and EDM2 ranges ``start:stop:step`` (inclusive).

    Returns (text, value) pairs, the text as typed (ranges: with the most decimals among start,
    stop and step), to name outputs ``sigma_rel_<text>``. Every value must lie in (0, 1/√12);
    duplicates are refused (their outputs would collide).

    Example:
        >>> parse_sigma_list("0.05, 0.10")
        [('0.05', 0.05), ('0.10', 0.1)]
        >>> [t for t, _ in parse_sigma_list("0.010:0.025:0.005")]
        ['0.010', '0.015', '0.020', '0.025']
    """
    if not isinstance(text, str) or not text.strip():
        raise _refuse(" needs at least one value", text)
    out: list[tuple[str, float]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise _refuse(f": empty entry in {text!r}", text)
        parts = [p.strip() for p in item.split(":")]
        if len(parts) == 1:
            value = _decimal(parts[0], item, text)
            out.append((parts[0], check_sigma_rel(float(value), "sigma_rels")))
            continue
        if len(parts) != 3:
            raise _refuse(f": range {item!r} must be start:stop:step", text)
        start, stop, step = (_decimal(p, item, text) for p in parts)
        if step <= 0:
            raise _refuse(f": range {item!r} needs a positive step", text)
        if stop < start:
            raise _refuse(f": range {item!r} ends before it starts", text)
        count = int((stop - start) // step) + 1
        if count > _MAX_LIST or len(out) + count > _MAX_LIST:
            raise _refuse(f": range {item!r} has {count} values (at most {_MAX_LIST})", text)
        # an int exponent: _NUMBER admits no NaN or infinity
        quantum = Decimal(1).scaleb(min(cast(int, d.as_tuple().exponent) for d in (start, stop, step)))
        for k in range(count):
            point = (start + k * step).quantize(quantum)
            out.append((format(point, "f"), check_sigma_rel(float(point), "sigma_rels")))
    seen: dict[float, str] = {}
    for label, sigma in out:
        if sigma in seen:
            raise _refuse(f": {label} is listed twice (also as {seen[sigma]})", text)
        seen[sigma] = label
    return out


def parse_gamma_list(text: str) -> list[tuple[str, float]]:
    """Parse a comma list of power-EMA exponents γ into (text, value) pairs, the text as typed.

    Each value must lie in [0, 1e6], else ``OptionError`` on ``gammas``. Duplicates are kept
    (the caller names outputs ``gamma_<text>`` and refuses collisions).

    Example:
        >>> parse_gamma_list("7")
        [('7', 7.0)]
    """
    return [(item, check_gamma(item, "gammas")) for item in (i.strip() for i in text.split(","))]


def power_profiles(sigma_rels: Sequence[str], gammas: Sequence[str]) -> list[tuple[str, float, str]]:
    """(output name, γ, value as typed) of every power-function EMA asked for, in order.

    Each ``sigma_rels`` text is a value, a comma list or a range; each ``gammas`` text a comma
    list. Outputs are named ``sigma_rel_<typed>`` / ``gamma_<typed>``; a profile asked for
    twice is refused (the outputs would collide).

    Example:
        >>> [(name, round(g, 2)) for name, g, _ in power_profiles(["0.05,0.1"], ["7"])]
        [('sigma_rel_0.05', 16.97), ('sigma_rel_0.1', 6.94), ('gamma_7', 7.0)]
    """
    named = [(f"sigma_rel_{typed}", sigma_rel_to_gamma(value), typed)
             for text in sigma_rels for typed, value in parse_sigma_list(text)]
    named += [(f"gamma_{typed}", value, typed) for text in gammas for typed, value in parse_gamma_list(text)]
    if len({name for name, _, _ in named}) != len(named):
        raise UsageError("the same profile is requested twice")
    return named


@dataclass(frozen=True, slots=True)
class MergeWeights:
    """How an average weighs its checkpoints: ``uniform``, a named decay schedule, or a
    learning-rate schedule read from a CSV file (``rates``: (step, rate) points)."""

    name: str
    rates: tuple[tuple[float, float], ...] = ()

    def coefficients(self, steps: Sequence[int]) -> list[float]:
        """One weight per checkpoint of ``steps`` (oldest first), summing to 1."""
        if self.rates:
            return rate_schedule_weights(steps, self.rates)
        if self.name == "uniform":
            return [1.0 / len(steps)] * len(steps) if steps else []
        return schedule_weights(self.name, len(steps))

    def to_json(self) -> dict[str, object]:
        return {"weights": self.name, **({"rates": [list(p) for p in self.rates]} if self.rates else {})}


WEIGHT_NAMES = ("uniform", *NAMED_SCHEDULES)
"""What ``weights`` accepts besides a CSV file of (step, learning rate)."""


def parse_weights(text: str | None) -> MergeWeights:
    """``weights`` as typed: ``uniform`` (the default), ``linear``, ``minus-sqrt``, ``cosine``
    (``wsm:`` may precede a name), or a CSV file of ``step,learning_rate`` rows.

    Example:
        >>> parse_weights("wsm:minus-sqrt")
        MergeWeights(name='minus-sqrt', rates=())
    """
    if text is None or text == "":
        return MergeWeights("uniform")
    name = text[4:] if text.startswith("wsm:") else text
    if name in WEIGHT_NAMES:
        return MergeWeights(name)
    if not name.lower().endswith(".csv"):
        raise OptionError("weights", f"must be one of {', '.join(WEIGHT_NAMES)}, or a CSV file of step,learning_rate "
                          f"rows; got {text!r}", value=text)
    return MergeWeights(os.path.basename(name), tuple(_read_rates(Path(name))))


def _read_rates(path: Path) -> list[tuple[float, float]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise OptionError("weights", f"cannot read {path}: {err.__class__.__name__}: {err}", value=str(path)) from None
    points: list[tuple[float, float]] = []
    for number, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [c.strip() for c in row]
        if not any(cells) or cells[0].startswith("#"):
            continue
        try:
            step, rate = float(cells[0]), float(cells[1])
        except (ValueError, IndexError):
            if not points and number == 1:
                continue  # a header row
            raise OptionError("weights", f"{path}, line {number}: expected step,learning_rate, got {row!r}",
                              value=str(path)) from None
        points.append((step, rate))
    if not points:
        raise OptionError("weights", f"{path}: no step,learning_rate rows", value=str(path))
    return points


def parse_count_list(text: str, option: str) -> list[int]:
    """Positive counts as typed: ``4``, ``2,4,8`` or ``2:16:2`` (a range, both ends included).

    Example:
        >>> parse_count_list("1,2:8:2", "last")
        [1, 2, 4, 6, 8]
    """
    counts: list[int] = []
    for item in (part.strip() for part in str(text).split(",")):
        try:
            bounds = [int(x) for x in item.split(":")] if item else []
        except ValueError:
            bounds = []
        if len(bounds) == 1:
            values = bounds
        elif len(bounds) == 3 and bounds[2] > 0 and bounds[0] <= bounds[1]:
            values = list(range(bounds[0], bounds[1] + 1, bounds[2]))
        else:
            raise OptionError(option, f"{item!r} is not a count, nor a start:stop:step range of counts", value=text)
        if any(v < 1 for v in values) or len(counts) + len(values) > _MAX_LIST:
            raise OptionError(option, f"{item!r}: counts must be positive (and at most {_MAX_LIST})", value=text)
        counts.extend(v for v in values if v not in counts)
    return counts
