"""Which state dict inside a single-file checkpoint is the model, and which step the file records.

Pure functions over the inert tree of :mod:`ema_ckpt.torch_records.tree` (no I/O, no tensor).

**The model.** A candidate is a dict of tensors: every value a tensor or a dict of tensors
(``*_extra_state`` entries may hold anything), found anywhere but under optimizer,
scheduler, scaler, loop, callback, RNG or configuration state (:data:`NON_MODEL`). The
well-known containers win in this order (:data:`MODEL_CONTAINERS`): ``state_dict``,
``model``, ``module``, ``model_state_dict``, ``net``, ``network``, ``params``, ``weights``;
then the EMA containers (:data:`EMA_CONTAINERS`: ``state_dict_ema``, ``model_ema``, ``ema``,
…); then the largest by bytes. A file holding no such dict but tensors beside other values
(``{"w": t, "epoch": 3}``) offers those tensors. A container whose only entry is another
dict is looked through. ``state_key`` names a candidate by its path (``state_dict_ema``,
``callbacks.EMA.state``); the model's keys are its own names, the container's never kept.
A wrapper's prefix on every key (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``)
is reported by :func:`wrapper_prefix`.

**The step.** :func:`step_in_tree`: ``global_step``, ``step``, ``iteration``, ``iter_num``,
``num_updates`` at the top level (or fairseq's ``optimizer_history[-1].num_updates``);
a file with only ``epoch`` counts epochs and says so.

Example:
    >>> tree = {"epoch": 3, "model": {"fc.weight": 1.0}, "optimizer": {"state": {}}}
    >>> [c.name for c in candidates(tree, is_tensor=lambda v: isinstance(v, float))]
    ['model']
    >>> step_in_tree({"global_step": 1000, "epoch": 3})
    (1000, 'global_step')
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MODEL_CONTAINERS = ("state_dict", "model", "module", "model_state_dict", "model_state", "net", "network",
                    "params", "weights")
"""Well-known names of the container holding a model's weights, most usual first."""
EMA_CONTAINERS = ("state_dict_ema", "model_ema", "ema", "ema_state_dict", "ema_model", "model_ema_state_dict",
                  "ema_state")
"""Containers of an EMA the training script kept (timm's ``state_dict_ema``): taken when alone."""
NON_MODEL = re.compile(
    r"optim|scheduler|scaler|^loops?$|^callbacks?$|^rng|random|^hyper_?param|^hparams|^args$|config"
    r"|^amp$|^loss_scaler|^trainer_state$|^dataloader|^data_loader|^sampler",
    re.IGNORECASE,
)
"""Names under which training state sits, never a model: never searched unless asked by name."""
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
"""Prefixes a wrapper puts on every key (``torch.compile``'s ``_orig_mod.``, DDP's ``module.``)."""
_EXTRA_STATE = "_extra_state"
STEP_FIELDS = ("global_step", "step", "iteration", "iter_num", "num_updates", "total_steps", "train_step")
"""Top-level entries that hold the optimizer step (Lightning's ``global_step``, nanoGPT's ``iter_num``)."""
EPOCH_FIELD = "epoch"
_MAX_DEPTH = 6


@dataclass(frozen=True, slots=True)
class Candidate:
    """One dict of tensors in a file: where it is, its tensors by the model's own names."""

    path: tuple[Any, ...]
    tensors: dict[str, Any]
    """{name inside the dict: tensor} (nested dicts joined with ``.``)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Entries that are not tensors (``*_extra_state``, or those left out of a mixed dict)."""
    strict: bool = True
    """Every value is a tensor (or a dict of them): a state dict, not tensors beside other values."""
    nbytes: int = 0

    @property
    def name(self) -> str:
        """The path as ``--state-key`` takes it: ``state_dict_ema``, ``callbacks.EMA.state``."""
        return ".".join(str(p) for p in self.path)


def _flatten(mapping: Mapping[Any, Any], is_tensor: Callable[[Any], bool], prefix: str = "",
             depth: int = 0) -> tuple[dict[str, Any], dict[str, Any], bool] | None:
    """({name: tensor}, {name: other value}, every value a tensor or a dict of them), or None
    when a key is not a string or the nesting is too deep."""
    tensors: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    strict = True
    for key, value in mapping.items():
        if not isinstance(key, str) or depth > _MAX_DEPTH:
            return None
        name = prefix + key
        if is_tensor(value):
            tensors[name] = value
        elif isinstance(value, dict) and value:
            inner = _flatten(value, is_tensor, name + ".", depth + 1)
            if inner is None or not inner[0]:
                strict = False
                extras[name] = value
                continue
            tensors.update(inner[0])
            extras.update(inner[1])
            strict = strict and inner[2]
        else:
            extras[name] = value
            if not key.endswith(_EXTRA_STATE):
                strict = False
    return tensors, extras, strict


def _looked_through(path: tuple[Any, ...], mapping: Mapping[Any, Any]) -> tuple[tuple[Any, ...], Mapping[Any, Any]]:
    """A container whose only entry is a dict stands for that dict (``{"model": {"state_dict": …}}``)."""
    while len(mapping) == 1:
        (key, value), = mapping.items()
        if not (isinstance(key, str) and isinstance(value, dict) and value):
            break
        path, mapping = (*path, key), value
    return path, mapping


def _dicts(root: Any, *, everywhere: bool) -> list[tuple[tuple[Any, ...], Mapping[Any, Any]]]:
    """Every dict in ``root`` with its path, breadth first; below :data:`NON_MODEL` names only
    when ``everywhere``."""
    found: list[tuple[tuple[Any, ...], Mapping[Any, Any]]] = []
    queue: list[tuple[tuple[Any, ...], Any]] = [((), root)]
    seen: set[int] = set()
    while queue:
        path, value = queue.pop(0)
        if not isinstance(value, dict) or id(value) in seen or len(path) > _MAX_DEPTH:
            continue
        seen.add(id(value))
        found.append((path, value))
        for key, child in value.items():
            if isinstance(key, str) and isinstance(child, dict) and (everywhere or not NON_MODEL.search(key)):
                queue.append(((*path, key), child))
    return found


def _known(name: Any) -> bool:
    return isinstance(name, str) and name.lower() in (*MODEL_CONTAINERS, *EMA_CONTAINERS)


def candidates(root: Any, *, is_tensor: Callable[[Any], bool], nbytes: Callable[[Any], int] = lambda _t: 0,
               everywhere: bool = False) -> list[Candidate]:
    """The dicts of tensors in ``root``, best first (see the module docstring).

    Strict candidates (state dicts) come first; a dict holding tensors beside other values is
    offered only when no state dict is found. The top level of a file of nested state dicts
    (``{"generator": …, "discriminator": …}``) is one candidate holding them all, unless one of
    them has a well-known container name.
    """
    strict: list[Candidate] = []
    loose: list[Candidate] = []
    covered: set[int] = set()
    for path, mapping in _dicts(root, everywhere=everywhere):
        if id(mapping) in covered:
            continue
        path, mapping = _looked_through(path, mapping)
        flat = _flatten(mapping, is_tensor)
        if flat is None or not flat[0]:
            continue
        tensors, extras, is_strict = flat
        direct = any(is_tensor(v) for v in mapping.values())
        if is_strict and (direct or path or not any(_known(k) for k in mapping)):
            strict.append(Candidate(path, tensors, extras, True, sum(nbytes(t) for t in tensors.values())))
            covered.update(id(d) for _, d in _dicts(mapping, everywhere=True))  # its parts are not models
        elif direct:  # tensors beside other values: those tensors, training state left out
            kept = {k: v for k, v in mapping.items() if not (isinstance(k, str) and NON_MODEL.search(k))}
            inner = _flatten(kept, is_tensor)
            if inner is not None and inner[0]:
                loose.append(Candidate(path, inner[0], inner[1], False, sum(nbytes(t) for t in inner[0].values())))
    return sorted(strict, key=_rank) or sorted(loose, key=_rank)


def _rank(candidate: Candidate) -> tuple[int, int, int]:
    last = str(candidate.path[-1]).lower() if candidate.path else ""
    if last in MODEL_CONTAINERS:
        group = MODEL_CONTAINERS.index(last)
    elif last in EMA_CONTAINERS:
        group = len(MODEL_CONTAINERS) + EMA_CONTAINERS.index(last)
    else:
        group = len(MODEL_CONTAINERS) + len(EMA_CONTAINERS)
    return group, len(candidate.path), -candidate.nbytes


def choose(found: Sequence[Candidate], state_key: str | None, every: Sequence[Candidate] = ()) -> Candidate | None:
    """The candidate ``state_key`` names (searched in ``every`` too), else the best, else None."""
    if state_key is None:
        return found[0] if found else None
    wanted = state_key.strip("./")
    for candidate in (*found, *every):
        if candidate.name == wanted or "/".join(str(p) for p in candidate.path) == wanted:
            return candidate
    return None


def wrapper_prefix(names: Sequence[str]) -> str | None:
    """The wrapper prefix every name carries (``module.``, ``_orig_mod.``, or both), or None."""
    prefix = ""
    while True:
        rest = [n[len(prefix):] for n in names]
        step = next((p for p in WRAPPER_PREFIXES if rest and all(r.startswith(p) and len(r) > len(p) for r in rest)),
                    None)
        if step is None:
            return prefix or None
        prefix += step


def step_in_tree(root: Any) -> tuple[int, str] | None:
    """(step, the entry it came from) of a file's top level, or None. Only plain ints count."""
    if not isinstance(root, dict):
        return None
    for name in STEP_FIELDS:
        value = root.get(name)
        if type(value) is int and value >= 0:
            return value, name
    history = root.get("optimizer_history")
    if isinstance(history, list) and history and isinstance(history[-1], dict):
        value = history[-1].get("num_updates")
        if type(value) is int and value >= 0:
            return value, "optimizer_history[-1].num_updates"
    return None


def epoch_in_tree(root: Any) -> int | None:
    """The top-level ``epoch``, when it is a plain int."""
    value = root.get(EPOCH_FIELD) if isinstance(root, dict) else None
    return value if type(value) is int and value >= 0 else None


__all__ = [
    "EMA_CONTAINERS",
    "MODEL_CONTAINERS",
    "NON_MODEL",
    "Candidate",
    "candidates",
    "choose",
    "epoch_in_tree",
    "step_in_tree",
    "wrapper_prefix",
]
