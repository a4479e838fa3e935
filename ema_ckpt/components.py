"""The components of a checkpoint: each network it holds, read by one format's reader.

A folder of no format of its own holds its components (diffusers' ``unet/`` and ``unet_ema/``),
unless its parts are named by steps (a folder of checkpoints). What names mean comes from
:mod:`ema_ckpt.layouts`.

Example:
    >>> import tempfile, numpy as np; from pathlib import Path; from safetensors.numpy import save_file
    >>> checkpoint = Path(tempfile.mkdtemp()) / "checkpoint-4"
    >>> for name in ("unet", "unet_ema"):
    ...     (checkpoint / name).mkdir(parents=True)
    ...     save_file({"w": np.ones(2, np.float32)}, checkpoint / name / "diffusion_pytorch_model.safetensors")
    >>> [(c.name, c.role) for c in components_of(resolve(checkpoint))[0]]
    [('unet', 'trained'), ('unet_ema', 'trainer EMA')]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import Note, OptionError
from .formats import Resolved, resolve
from .formats.torch_file import SUFFIXES as TORCH_SUFFIXES
from .layouts import EXPORT_MARKERS, MAIN_WEIGHTS, NOT_COMPONENTS, TRAINER_KEPT_EMA
from .manifest import MANIFEST_NAME
from .steps import name_stem, step_in_name
from .storage import Location

FOLDER_OF_CHECKPOINTS = "a folder of checkpoints"
"""Why a folder inside a sequence whose parts are named by steps is no checkpoint: it is a sequence."""
CHECKPOINT_FILE_SUFFIXES = (*TORCH_SUFFIXES, ".safetensors")
"""Files a folder scan looks at as possible checkpoints; other files are left unread."""


@dataclass(frozen=True, slots=True)
class Component:
    """A network a checkpoint holds: its path inside it (``unet``; ``""`` for the checkpoint's own
    model) and its ``role``, ``trained`` or ``trainer EMA`` (averaged only when chosen)."""

    name: str
    path: Location
    format_name: str
    role: str = "trained"


TRAINED = "trained"
TRAINER_EMA = "trainer EMA"


@dataclass(frozen=True, slots=True)
class LeftPart:
    """A model-bearing part of a checkpoint that is not read, and why."""

    path: Location
    why: str

    def to_json(self) -> dict[str, str]:
        return {"path": str(self.path), "why": str(Note.of(self.why))}


def holds_checkpoints(path: str | Location | Resolved) -> bool:
    """True when a directory's own children are checkpoints (a folder of them, not one)."""
    found = resolve(path)
    path = found.path
    if not path.is_dir() or found.model.trainer is not None:
        return False
    return any(
        child.is_dir() and not child.name.startswith(".") and (resolve(child).format is not None
                                                                or components_inside(child)[0])
        for child in path.iterdir()
    )


def export_parts(folder: Location) -> set[str]:
    """Names an export marker in ``folder`` lists (a diffusers pipeline's ``unet``, ``vae``, …)."""
    parts: set[str] = set()
    for marker in EXPORT_MARKERS:
        try:
            doc = json.loads((folder / marker).read_bytes())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(doc, dict):
            parts |= {k for k in doc if isinstance(k, str) and not k.startswith("_")}
    return parts


def _component_name(checkpoint: Location, path: Location) -> str:
    return name_stem(path.name) if path.parent == checkpoint else path.name


def _role(name: str) -> str:
    return TRAINER_EMA if TRAINER_KEPT_EMA.search(name) else TRAINED


def model_child(child: Location) -> Resolved | None:
    """``child`` resolved when it holds a model of a known format, else None."""
    if child.name.startswith(".") or NOT_COMPONENTS.match(name_stem(child.name)):
        return None
    if child.is_dir():
        if (child / MANIFEST_NAME).exists():
            return None
    elif not child.name.lower().endswith(CHECKPOINT_FILE_SUFFIXES):
        return None
    found = resolve(child)
    return found if found.format is not None else None


def components_inside(folder: Location) -> tuple[list[Component], list[LeftPart]]:
    """The model-bearing folders and files inside a folder that is no checkpoint of its own
    (diffusers' ``checkpoint-N/unet/``, LitGPT's ``step-N/lit_model.pth``)."""
    components: list[Component] = []
    try:
        children: list[Location] = sorted(folder.iterdir(), key=lambda c: c.name)
    except OSError:
        return [], []
    for child in children:
        try:
            found = model_child(child)
        except OSError:  # unreadable: said when it is scanned as an entry of its own
            continue
        if found is not None and found.format is not None:
            name = _component_name(folder, child)
            components.append(Component(name, child, found.format.name, _role(name)))
    if any(step_in_name(c.name) is not None for c in components):  # step_5/, checkpoint-1.pth.tar: checkpoints
        return [], [LeftPart(folder, FOLDER_OF_CHECKPOINTS)]
    return components, []


def components_of(found: Resolved) -> tuple[list[Component], list[LeftPart]]:
    """A checkpoint's components (its own model, and model files beside its weights), and the
    model-bearing parts left (a main weights file beside weights read in another format: a copy).

    Example:
        >>> import tempfile, numpy as np; from pathlib import Path; from safetensors.numpy import save_file
        >>> checkpoint = Path(tempfile.mkdtemp()) / "checkpoint_3"; checkpoint.mkdir()
        >>> for name in ("model.safetensors", "model_1.safetensors"):   # accelerate's two models
        ...     save_file({"w": np.ones(2, np.float32)}, checkpoint / name)
        >>> [c.name for c in components_of(resolve(checkpoint))[0]]
        ['model', 'model_1']
    """
    path = found.path
    if found.format is None:
        return components_inside(path) if path.is_dir() else ([], [])
    main = Component("", path, found.format.name)
    if not path.is_dir() or (found.model.path != path and found.model.trainer is None):
        return [main], []
    components: list[Component] = []
    left: list[LeftPart] = []
    try:
        children: list[Location] = sorted(path.iterdir(), key=lambda c: c.name)
    except OSError:
        return [main], []
    for child in children:
        if child.is_dir() or not child.name.lower().endswith(CHECKPOINT_FILE_SUFFIXES):
            continue
        if found.model.path == path and found.format.name in ("safetensors", "torch") and (
                MAIN_WEIGHTS.match(child.name) or _only_file(children, child)):
            continue  # the weights the checkpoint's own reader reads
        own_files = found.format.name not in ("safetensors", "torch")  # DCP records, DeepSpeed rank files
        if own_files and not MAIN_WEIGHTS.match(child.name):
            continue
        part = model_child(child)
        if part is None or part.format is None:
            continue
        if MAIN_WEIGHTS.match(child.name):
            left.append(LeftPart(child, f"the same model's {child.name} ({found.format.name} weights "
                                        f"{_shown(found.model.path, path)} are read; name the file to read it)"))
            continue
        name = _component_name(path, child)
        components.append(Component(name, child, part.format.name, _role(name)))
    for other in found.model.others:  # a trainer's further nested models (accelerate's pytorch_model_fsdp_1/)
        nested = resolve(path / other)
        if nested.format is not None:
            components.append(Component(other, path / other, nested.format.name, _role(other)))
    if components:  # several models: each by its file's (or folder's) name, each its own output folder
        own = found.model.path.name if found.model.path != path else next(
            (name_stem(c.name) for c in children if not c.is_dir() and MAIN_WEIGHTS.match(c.name)
             and not c.name.endswith(".json")), "model")
        main = Component(own, path, found.format.name)
    return [main, *components], left


def _only_file(children: Sequence[Location], child: Location) -> bool:
    """``child`` is the folder's one file of its suffix (what a reader of the folder reads)."""
    suffix = ".safetensors" if child.name.endswith(".safetensors") else None
    return suffix is not None and sum(c.name.endswith(suffix) for c in children) == 1


def _shown(model: Location, path: Location) -> str:
    return "of the folder" if model == path else f"in {model.name}/"


def chosen_components(entry: Location, components: Sequence[Component], wanted: str | None, *,
                      every: bool = False) -> list[Component] | str:
    """The components read of the checkpoint ``entry``: the one ``wanted`` names, else its trained
    ones (``every``: all; else an ``OptionError`` for several), or why none is (a note)."""
    if wanted is not None:
        wanted = wanted.strip("/")
        named = [c for c in components if c.name == wanted or (wanted in ("", ".") and c.name == "")]
        if not named:
            names = ", ".join(c.name or "(the checkpoint)" for c in components)
            return Note(f"holds no component {wanted!r} ({{component}}; it holds {names})", mentions=("component",))
        return named
    trained = [c for c in components if c.role == TRAINED] or list(components)
    if len(trained) > 1 and not every:
        names = ", ".join(c.name or "(the checkpoint)" for c in trained)
        raise OptionError("component", f"{entry} holds {len(trained)} models ({names}); this command reads one: "
                          "choose it with {component}", value=None)
    return trained


def unread_parts(components: Sequence[Component], left: Sequence[LeftPart], wanted: str | None) -> list[LeftPart]:
    """The model-bearing parts of a taken checkpoint that are not read, each with the reason: the
    copies in ``left``, and the EMAs the trainer kept (unless ``wanted``)."""
    return [*left, *(LeftPart(c.path, Note(f"an EMA the trainer kept ({c.name}): not averaged again; choose it "
                                           "with {component}", mentions=("component",)))
                     for c in components if c.role == TRAINER_EMA and c.name != wanted)]
