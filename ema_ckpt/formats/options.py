"""How checkpoints are read during one command: which state dict of a file, which pickled classes.
Made once from the command's options and passed to every reader it opens, on every worker.

Example:
    >>> ReadOptions(state_key="state_dict_ema").recorded()
    {'state_key': 'state_dict_ema'}
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OptionError
from ..pickles.rules import standard_module_matched


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """``state_key``: the state dict to read inside a single-file checkpoint (``state_dict_ema``);
    ``inert_globals``: pickled classes (``module.Name`` or ``module.*``) to read as inert data;
    ``keep_prefix``: keep every key's prefix, even a wrapper's (DDP's ``module.``) that the
    file's writer drops when it loads (:func:`~ema_ckpt.formats.torch_file.model.key_prefix`)."""

    state_key: str | None = None
    inert_globals: tuple[str, ...] = ()
    keep_prefix: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "inert_globals", tuple(self.inert_globals))
        for pattern in self.inert_globals:
            if "." not in pattern or pattern.startswith(".") or any(c.isspace() for c in pattern):
                raise OptionError("inert_globals", f"{pattern!r} is not a module.Name (or module.*) pattern",
                                  value=pattern)
            module = standard_module_matched(pattern)
            if module is not None:
                raise OptionError(
                    "inert_globals", f"{pattern!r} would admit names of Python's own module {module} "
                    "(the standard library and the OS: functions, not a training script's data); name the "
                    "script's own classes (myproj.Config or myproj.*)", value=pattern)
        if self.state_key is not None and not self.state_key.strip("./"):
            raise OptionError("state_key", "must name a key of the file, e.g. state_dict_ema", value=self.state_key)

    def recorded(self) -> dict[str, object]:
        """What an output's manifest records of these (the choice shapes the result)."""
        recorded: dict[str, object] = {"state_key": self.state_key} if self.state_key is not None else {}
        if self.keep_prefix:
            recorded["keep_prefix"] = True
        return recorded


DEFAULT_READ = ReadOptions()
"""A file read as its writer's loader reads it: its model's state dict, no other classes."""


def read_options_from(settings: object) -> ReadOptions:
    """The read options a command's settings carry, checked."""
    return ReadOptions(getattr(settings, "state_key", None), tuple(getattr(settings, "inert_globals", ())),
                       bool(getattr(settings, "keep_prefix", False)))


__all__ = ["DEFAULT_READ", "ReadOptions", "read_options_from"]
