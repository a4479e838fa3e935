"""Which state dict inside a single-file checkpoint is the model, and which step the file records:
pure functions over the inert tree of :mod:`ema_ckpt.torch_records.tree`.

**The model.** A candidate is a dict of tensors (every value a tensor or a dict of them,
``*_extra_state`` entries anything), or the tensors of a dict holding other values too, found
anywhere but under training state (:data:`NON_MODEL`). The well-known containers win in the order
of :data:`MODEL_CONTAINERS`, then :data:`EMA_CONTAINERS`, then the largest by bytes; a container
whose only entry is a dict is looked through, and a pickled ``torch.nn.Module`` stands for its
state dict. ``state_key`` names a candidate by its path (``callbacks.EMA.state``).

**The names.** A wrapper's prefix (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``) is
dropped only where the framework that wrote the file drops it when loading (:func:`key_prefix`).

Example:
    >>> tree = {"epoch": 3, "model": {"fc.weight": 1.0}, "optimizer": {"state": {}}}
    >>> [c.name for c in candidates(tree, is_tensor=lambda v: isinstance(v, float))]
    ['model']
    >>> step_in_tree({"global_step": 1000, "epoch": 3})
    (1000, 'global_step')
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...layouts import EPOCHS, SAVERS, WRAPPER_PREFIXES, Saver, best_step, counters_in
from ...torch_records.tree import Opaque, is_module, module_state_dict

MODEL_CONTAINERS = ("state_dict", "model", "module", "model_state_dict", "model_state", "net", "network",
                    "params", "weights")
"""Well-known names of the container holding a model's weights, most usual first."""
EMA_CONTAINERS = ("state_dict_ema", "model_ema", "ema", "ema_state_dict", "ema_model", "model_ema_state_dict",
                  "ema_state")
"""Containers of an EMA the training script kept (timm's ``state_dict_ema``): taken when alone."""
_NAMED = (*MODEL_CONTAINERS, *EMA_CONTAINERS)
NON_MODEL = re.compile(
    r"optim|scheduler|scaler|^loops?$|^callbacks?$|^rng|random|^hyper_?param|^hparams|^args$|config"
    r"|^amp$|^loss_scaler|^trainer_state$|^dataloader|^data_loader|^sampler",
    re.IGNORECASE,
)
"""Names under which training state sits, never a model: never searched unless asked by name."""
_EXTRA_STATE = "_extra_state"
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
    repeated: bool = False
    """A dict inside it appears twice (or holds itself): no state dict does; reading it is refused."""

    @property
    def name(self) -> str:
        """The path as ``--state-key`` takes it: ``state_dict_ema``, ``callbacks.EMA.state``."""
        return ".".join(str(p) for p in self.path)


@dataclass(slots=True)
class _Flat:
    tensors: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    strict: bool = True
    repeated: bool = False


def _flatten(mapping: Mapping[Any, Any], is_tensor: Callable[[Any], bool], prefix: str = "", depth: int = 0,
             seen: set[int] | None = None) -> _Flat | None:
    """Its tensors and other values by joined name, whether every value is a tensor or a dict
    of them, and whether a dict repeats; None when a key is not a string or nesting runs deep."""
    seen = {id(mapping)} if seen is None else seen
    flat = _Flat()
    for key, value in mapping.items():
        if not isinstance(key, str) or depth > _MAX_DEPTH:
            return None
        name = prefix + key
        if is_tensor(value):
            flat.tensors[name] = value
        elif isinstance(value, dict) and id(value) in seen:
            flat.repeated = True
        elif isinstance(value, dict) and value:
            seen.add(id(value))
            inner = _flatten(value, is_tensor, name + ".", depth + 1, seen)
            if inner is None or not inner.tensors:
                flat.strict = False
                flat.extras[name] = value
                continue
            flat.tensors.update(inner.tensors)
            flat.extras.update(inner.extras)
            flat.strict = flat.strict and inner.strict
            flat.repeated = flat.repeated or inner.repeated
        else:
            flat.extras[name] = value
            if not key.endswith(_EXTRA_STATE):
                flat.strict = False
    return flat


def _looked_through(path: tuple[Any, ...], mapping: Mapping[Any, Any], everywhere: bool
                    ) -> tuple[tuple[Any, ...], Mapping[Any, Any]]:
    """A container whose only entry is a dict stands for that dict (``{"model": {"state_dict": …}}``)."""
    while len(mapping) == 1:
        (key, value), = mapping.items()
        if not (isinstance(key, str) and isinstance(value, dict) and value) or (
                not everywhere and NON_MODEL.search(key)):
            break
        path, mapping = (*path, key), value
    return path, mapping


def _dicts(root: Any, *, everywhere: bool) -> list[tuple[tuple[Any, ...], Mapping[Any, Any]]]:
    """Every dict in ``root`` with its path, breadth first; below :data:`NON_MODEL` names only
    when ``everywhere``."""
    found: list[tuple[tuple[Any, ...], Mapping[Any, Any]]] = []
    queue: collections.deque[tuple[tuple[Any, ...], Any]] = collections.deque([((), root)])
    seen: set[int] = set()
    while queue:
        path, value = queue.popleft()  # a deque: linear in the number of entries, however wide
        if not isinstance(value, dict) or id(value) in seen or len(path) > _MAX_DEPTH:
            continue
        seen.add(id(value))
        found.append((path, value))
        for key, child in value.items():
            if isinstance(key, str) and isinstance(child, dict) and (everywhere or not NON_MODEL.search(key)):
                queue.append(((*path, key), child))
    return found


def modules_as_state_dicts(value: Any, depth: int = 0) -> Any:
    """``value`` with every pickled ``torch.nn.Module`` in its dicts replaced by the state dict it
    would give (``torch.save(model)``, ultralytics' ``{"model": <module>, "ema": <module>}``)."""
    if is_module(value):
        return module_state_dict(value)
    if isinstance(value, dict) and not isinstance(value, Opaque) and depth <= _MAX_DEPTH:
        changed = {k: modules_as_state_dicts(v, depth + 1) for k, v in value.items()}
        if any(changed[k] is not v for k, v in value.items()):
            return changed
    return value


def candidates(root: Any, *, is_tensor: Callable[[Any], bool], nbytes: Callable[[Any], int] = lambda _t: 0,
               everywhere: bool = False) -> list[Candidate]:
    """The dicts of tensors in ``root``, best first (see the module docstring); the top level of
    nested state dicts (``{"generator": …, "discriminator": …}``) is one candidate holding them
    all, unless one of them has a well-known container name."""
    strict: list[Candidate] = []
    loose: list[Candidate] = []
    covered: set[int] = set()
    root = modules_as_state_dicts(root)
    for path, mapping in _dicts(root, everywhere=everywhere):
        if id(mapping) in covered:
            continue
        path, mapping = _looked_through(path, mapping, everywhere)
        flat = _flatten(mapping, is_tensor)
        if flat is None or not flat.tensors:
            continue
        direct = any(is_tensor(v) for v in mapping.values())
        if flat.strict and (direct or path or not any(isinstance(k, str) and k.lower() in _NAMED for k in mapping)):
            strict.append(Candidate(path, flat.tensors, flat.extras, True, sum(map(nbytes, flat.tensors.values())),
                                    flat.repeated))
            covered.update(id(d) for _, d in _dicts(mapping, everywhere=True))  # its parts are not models
        elif direct:  # tensors beside other values: those tensors, training state left out
            kept = {k: v for k, v in mapping.items() if not (isinstance(k, str) and NON_MODEL.search(k))}
            inner = _flatten(kept, is_tensor, seen={id(mapping)})
            if inner is not None and inner.tensors:
                loose.append(Candidate(path, inner.tensors, inner.extras, False,
                                       sum(map(nbytes, inner.tensors.values())), inner.repeated))
    return sorted(strict + loose, key=_rank)


def _rank(candidate: Candidate) -> tuple[int, bool, int, int]:
    last = str(candidate.path[-1]).lower() if candidate.path else ""
    group = _NAMED.index(last) if last in _NAMED else len(_NAMED)
    # among the unnamed, the most weights win: the top level of {"w": …, "b": …, "epoch": 3} over a part of it
    return group, group < len(_NAMED) and not candidate.strict, -candidate.nbytes, len(candidate.path)


def choose(found: Sequence[Candidate], state_key: str | None, every: Sequence[Candidate] = ()) -> Candidate | None:
    """The candidate ``state_key`` names (searched in ``every`` too), else the best, else None."""
    if state_key is None:
        return found[0] if found else None
    wanted = state_key.strip("./")
    return next((c for c in (*found, *every) if c.name == wanted or "/".join(map(str, c.path)) == wanted), None)


def wrapper_prefix(names: Sequence[str], prefixes: Sequence[str] = WRAPPER_PREFIXES) -> str | None:
    """The wrapper prefix every name carries (``module.``, ``_orig_mod.``, or both, in any
    order), or None; ``prefixes``: the wrappers' prefixes looked for."""
    prefix = ""
    while True:
        rest = [n[len(prefix):] for n in names]
        step = next((p for p in prefixes if rest and all(r.startswith(p) and len(r) > len(p) for r in rest)), None)
        if step is None:
            return prefix or None
        prefix += step


@dataclass(frozen=True, slots=True)
class KeyPrefix:
    """The prefix dropped from every key (or None), the wrapper prefix found, who wrote the
    file, and why, in words."""

    dropped: str | None
    found: str | None
    saver: str
    why: str


def key_prefix(root: Any, chosen: Candidate, *, keep: bool = False, savers: Sequence[Saver] = SAVERS) -> KeyPrefix:
    """Which wrapper prefix of ``chosen``'s keys is dropped, as the file's writer drops it (see
    :data:`SAVERS`); ``keep``: none, whoever wrote it (``keep_prefix``)."""
    names = list(chosen.tensors)
    found = wrapper_prefix(names)
    saver = next(s for s in (*savers, _ANY) if s.recognises(root))
    depth = len(chosen.path)
    if found is None:
        return KeyPrefix(None, None, saver.name, "none dropped: no wrapper prefix on every key")
    if keep:
        return KeyPrefix(None, found, saver.name, f"none dropped: {found} kept (keep_prefix)")
    dropped = wrapper_prefix(names, saver.drops) if depth <= saver.deepest else None
    if dropped is not None:
        return KeyPrefix(dropped, found, saver.name, f"{dropped} dropped: {saver.why}")
    if depth > saver.deepest and saver.drops:
        reason = (f"the state dict sits {depth} containers deep, where no wrapper's loader strips a prefix "
                  f"({saver.name})")
    else:
        reason = saver.why
    return KeyPrefix(None, found, saver.name, f"none dropped: {found} kept, {reason}")


_ANY = Saver("a plain training loop", (), WRAPPER_PREFIXES, 1, "a plain training loop's state dict")


def step_in_tree(root: Any) -> tuple[int, str] | None:
    """(step, the record it came from) of a file's records, or None: the plain-int counter of
    optimizer steps :mod:`ema_ckpt.layouts` ranks first (``global_step``, mmengine's ``meta.iter``)."""
    best = best_step(counters_in(root)) if isinstance(root, dict) else None
    return (best.value, best.path) if best is not None else None


def epoch_in_tree(root: Any) -> int | None:
    """The epoch a file records (top-level ``epoch``, mmengine's ``meta.epoch``, …), when it is a plain int."""
    epochs = [c for c in counters_in(root) if c.counts == EPOCHS] if isinstance(root, dict) else []
    return epochs[0].value if epochs else None


__all__ = [
    "EMA_CONTAINERS",
    "MODEL_CONTAINERS",
    "NON_MODEL",
    "SAVERS",
    "Candidate",
    "KeyPrefix",
    "Saver",
    "candidates",
    "choose",
    "epoch_in_tree",
    "key_prefix",
    "step_in_tree",
    "wrapper_prefix",
]
