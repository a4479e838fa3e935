"""What ema-ckpt knows about trainers' checkpoint folders, as data: one registry of layout records.

Discovery, steps, saves in progress and ``inspect`` all read these records; a new trainer is
one record here (and one fixture), never a branch in the code. The general model (sequence
roots, checkpoints, components, step records, aliases and exports) is in ``docs/formats.md``.

Example:
    >>> counter_meaning("state.timestamp.batch").counts
    'optimizer steps'
    >>> bool(TRAINER_KEPT_EMA.search("unet_ema"))
    True
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPTIMIZER_STEPS = "optimizer steps"
MICRO_BATCHES = "micro-batches"
EPOCHS = "epochs"
SAMPLES = "samples"
TOKENS = "tokens"
SAVES = "saves"


@dataclass(frozen=True, slots=True)
class Counter:
    """A counter a trainer records, by the end of its dotted path (``global_step``,
    ``timestamp.batch``), what it counts, and its rank among counters of optimizer steps
    (lower wins: ``step_count`` over ``iter_num`` where a file keeps both)."""

    path: str
    counts: str
    rank: int = 0

    def matches(self, dotted: str) -> bool:
        dotted = dotted.lower()
        return dotted == self.path or dotted.endswith("." + self.path)


COUNTERS: tuple[Counter, ...] = (
    Counter("global_step", OPTIMIZER_STEPS, 0),  # Lightning, the Hugging Face Trainer, OLMo-core
    Counter("global_steps", OPTIMIZER_STEPS, 0),  # DeepSpeed
    Counter("step_count", OPTIMIZER_STEPS, 0),  # LitGPT
    Counter("optimizer_step", OPTIMIZER_STEPS, 0),
    Counter("optimizer_steps", OPTIMIZER_STEPS, 0),
    Counter("num_updates", OPTIMIZER_STEPS, 0),  # fairseq
    Counter("ss_steps", OPTIMIZER_STEPS, 0),  # kohya-ss sd-scripts (safetensors metadata)
    Counter("timestamp.batch", OPTIMIZER_STEPS, 1),  # Composer
    Counter("updates", OPTIMIZER_STEPS, 1),  # ultralytics (EMA updates)
    Counter("optimization_step", OPTIMIZER_STEPS, 1),  # diffusers EMAModel
    Counter("steps_run", OPTIMIZER_STEPS, 1),  # torchtune
    Counter("step", OPTIMIZER_STEPS, 2),
    Counter("train_step", OPTIMIZER_STEPS, 2),
    Counter("total_steps", OPTIMIZER_STEPS, 2),
    Counter("iteration", OPTIMIZER_STEPS, 3),  # detectron2
    Counter("meta.iter", OPTIMIZER_STEPS, 3),  # mmengine
    Counter("iter", OPTIMIZER_STEPS, 3),
    Counter("iter_num", OPTIMIZER_STEPS, 4),  # nanoGPT (LitGPT: micro-batches, beside step_count)
    Counter("micro_step", MICRO_BATCHES),
    Counter("micro_steps", MICRO_BATCHES),
    Counter("micro_batch", MICRO_BATCHES),
    Counter("micro_batches", MICRO_BATCHES),
    Counter("batch_idx", MICRO_BATCHES),
    Counter("timestamp.sample", SAMPLES),  # Composer
    Counter("consumed_samples", SAMPLES),  # Megatron
    Counter("samples_seen", SAMPLES),
    Counter("timestamp.token", TOKENS),  # Composer
    Counter("global_train_tokens", TOKENS),  # OLMo-core
    Counter("consumed_tokens", TOKENS),
    Counter("tokens_seen", TOKENS),
    Counter("epoch", EPOCHS),
    Counter("epochs", EPOCHS),
    Counter("ss_epoch", EPOCHS),  # kohya-ss sd-scripts
    Counter("epochs_run", EPOCHS),  # torchtune
    Counter("cur_epoch", EPOCHS),
)
"""Every counter a trainer is known to record, in order of preference within each meaning (the
comment names who writes it)."""

COUNTER_CONTAINERS_SKIPPED = re.compile(
    r"^(optim|optimizer)s?(_state(_dict)?|_states)?$|^optimizer_\d+$|sched|scaler|^rng|random|^args$"
    r"|^hyper_?param|^hparams$|^cfg$|config|^train_args$|^dataloader|^data_loader|^sampler|^callbacks?$|^loops?$"
    r"|_in_epoch$|^metric|^model$|^state_dict|^module$|^ema$",
    re.IGNORECASE,
)
"""Containers whose integers are never a checkpoint's step: optimizer and scheduler counters,
the planned run (``args.epochs``, ``max_steps``), per-epoch positions, the model itself."""
_MAX_COUNTER_DEPTH = 4
_MAX_COUNTER_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class SeenCounter:
    """A counter found in a record: where (dotted path), its value, what it counts."""

    path: str
    value: int
    counter: Counter

    @property
    def counts(self) -> str:
        return self.counter.counts


def counter_meaning(dotted: str) -> Counter | None:
    """The :class:`Counter` a dotted record path is, or None (``state.timestamp.batch``)."""
    return next((c for c in COUNTERS if c.matches(dotted)), None)


def counters_in(record: object, prefix: str = "") -> list[SeenCounter]:
    """Every known counter in a record of plain data: non-negative ints (or strings of digits),
    in dicts nested up to 4 deep and the last entry of a list (fairseq's
    ``optimizer_history[-1].num_updates``), outside :data:`COUNTER_CONTAINERS_SKIPPED`.

    Example:
        >>> [(c.path, c.value) for c in counters_in({"meta": {"epoch": 3, "iter": 120}})]
        [('meta.epoch', 3), ('meta.iter', 120)]
    """
    found: list[SeenCounter] = []
    todo: collections.deque[tuple[object, str, int]] = collections.deque([(record, prefix, 0)])
    seen = 0
    while todo and seen < _MAX_COUNTER_ENTRIES:
        value, path, depth = todo.popleft()
        if isinstance(value, dict):
            for key, item in list(value.items())[:_MAX_COUNTER_ENTRIES]:
                seen += 1
                if not isinstance(key, str):
                    continue
                dotted = f"{path}.{key}" if path else key
                number = _plain_count(item)
                if number is not None:
                    meaning = counter_meaning(dotted)
                    if meaning is not None:
                        found.append(SeenCounter(dotted, number, meaning))
                elif isinstance(item, (dict, list, tuple)) and depth < _MAX_COUNTER_DEPTH \
                        and not COUNTER_CONTAINERS_SKIPPED.search(key):
                    todo.append((item, dotted, depth + 1))
        elif isinstance(value, (list, tuple)) and value:
            todo.append((value[-1], f"{path}[-1]", depth + 1))
    return found


def _plain_count(value: object) -> int | None:
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 19:
        return int(value)
    return None


def best_step(counters: list[SeenCounter]) -> SeenCounter | None:
    """The counter of optimizer steps to take among ``counters`` (lowest rank, then first found)."""
    steps = [c for c in counters if c.counts == OPTIMIZER_STEPS]
    return min(steps, key=lambda c: c.counter.rank) if steps else None


def counter_named(counters: list[SeenCounter], name: str) -> SeenCounter | None:
    """The counter ``--step-from NAME`` names: its dotted path, or the end of it."""
    wanted = name.strip(".").lower()
    exact = [c for c in counters if c.path.lower() == wanted]
    ends = exact or [c for c in counters if c.path.lower().endswith("." + wanted)]
    return ends[0] if ends else None


@dataclass(frozen=True, slots=True)
class NameLabel:
    """Words that label a number in a checkpoint's name (``step=1000``, ``ba4``, ``ep0``) and what
    the number then counts; ``rank`` orders labels of optimizer steps (lower wins)."""

    words: tuple[str, ...]
    counts: str
    rank: int = 0


NAME_LABELS: tuple[NameLabel, ...] = (
    NameLabel(("step", "steps", "global_step", "globalstep", "gs"), OPTIMIZER_STEPS, 0),
    NameLabel(("ba", "batch"), OPTIMIZER_STEPS, 1),
    NameLabel(("iter", "iteration", "it"), OPTIMIZER_STEPS, 2),
    NameLabel(("checkpoint", "ckpt", "model", "weights", "save", "checkpoint_step"), SAVES),
    NameLabel(("ep", "epoch", "e"), EPOCHS),
    NameLabel(("tok", "tokens", "token"), TOKENS),
    NameLabel(("sample", "samples", "sp"), SAMPLES),
    NameLabel(("rank", "r", "of", "mp_rank", "dp_rank", "tp", "pp", "shard", "part"), "ranks"),
)
"""Labels of numbers in names; ``checkpoint-12`` counts saves or steps (the only number is taken,
as the Hugging Face Trainer names its folders), a rank or shard number is never a step."""


@dataclass(frozen=True, slots=True)
class NestedModel:
    """A trainer's checkpoint folder whose model weights sit in a subdirectory ``pattern`` names.

    ``optimizer``: the sibling holding that model's optimizer state; ``beside``: a sibling that
    must exist too, and ``marker`` a file the nested folder must hold (where the name alone is
    common); ``others``: names of further models of the same trainer.
    """

    trainer: str
    pattern: re.Pattern[str]
    optimizer: str | None = None
    beside: str | None = None
    marker: str | None = None
    others: re.Pattern[str] | None = None


NESTED_MODELS: tuple[NestedModel, ...] = (
    NestedModel("accelerate", re.compile(r"^pytorch_model_fsdp_0$"), optimizer="optimizer_0",
                others=re.compile(r"^pytorch_model_fsdp_[1-9]\d*$")),
    NestedModel("NeMo", re.compile(r"^weights$"), beside="context", marker="metadata.json"),
    NestedModel("OLMo-core", re.compile(r"^model_and_optim$")),
)


@dataclass(frozen=True, slots=True)
class TrainerSave:
    """A trainer's checkpoint folder and the file it writes last: a folder of that name without
    it (and with a file the trainer writes earlier) is a save in progress."""

    trainer: str
    folder: re.Pattern[str]
    written_last: str
    written_before: tuple[str, ...]
    written_before_prefixes: tuple[str, ...] = ()


TRAINER_STATE = "trainer_state.json"
HF_TRAINER = TrainerSave(
    "the Trainer", re.compile(r"^checkpoint-\d+$"), TRAINER_STATE,
    ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"), ("rng_state", "global_step"),
)
ACCELERATE = TrainerSave(
    "accelerate's save_state", re.compile(r"^checkpoint_\d+$"), "random_states_0.pkl",
    ("optimizer.bin", "scheduler.bin", "model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin"),
    ("pytorch_model_fsdp", "optimizer_"),
)
"""Its ``checkpoint_<i>`` folders count saves, not steps (``steps.accelerate_folder``)."""
TRAINER_SAVES: tuple[TrainerSave, ...] = (HF_TRAINER, ACCELERATE)
ACCELERATE_OPTIMIZER = "optimizer.bin"
"""What accelerate's ``save_state`` writes the (first) optimizer's state to, beside unnested weights."""


@dataclass(frozen=True, slots=True)
class StepFile:
    """A file a trainer writes beside the weights that records the step: ``path`` relative to the
    checkpoint folder, its kind (``json`` or ``torch``)."""

    path: str
    kind: str


STEP_FILES: tuple[StepFile, ...] = (
    StepFile(TRAINER_STATE, "json"),  # global_step, by the Hugging Face Trainer
    StepFile("train/rank0.pt", "torch"),  # global_step, by OLMo-core
    StepFile(".metadata.json", "json"),  # global_step, by OLMo-core
    StepFile("meta.json", "json"),  # global_step
    StepFile("recipe_state.pt", "torch"),  # steps_run, by torchtune
)


TRAINER_KEPT_EMA = re.compile(r"(^|[_.-])ema([_.-]|$)|^ema", re.IGNORECASE)
"""A component that is an EMA the trainer kept itself (``unet_ema``, ``ema_model``): not averaged
again unless chosen by name (the ``component`` option)."""
NOT_COMPONENTS = re.compile(
    r"^(optimizer|optim|scheduler|scaler|random_states|rng_state|training_args|lr_scheduler|train|logs?|runs"
    r"|tokenizer|feature_extractor|image_processor|wandb|tensorboard)([_.-].*)?$",
    re.IGNORECASE,
)
"""Names inside a checkpoint that are never a component (optimizer and loop state, tokenizers)."""
ALIAS_NAMES = re.compile(r"^(last|latest|best|model_best|final)([-_.=]|$)", re.IGNORECASE)
"""Names of copies of another checkpoint (``last.ckpt``, ``model_best.pth.tar``): the other is kept."""
MAIN_WEIGHTS = re.compile(
    r"^(model|diffusion_pytorch_model|adapter_model|pytorch_lora_weights|pytorch_model|pytorch_model_fsdp"
    r"|pytorch_model_fsdp_0)(-\d+-of-\d+)?(\.[0-9a-z-]+)?\.(safetensors|bin)$|\.index\.json$",
    re.IGNORECASE,
)
"""Names of a folder's main weights files (and shards): beside a model read in another format,
copies of it, not further components."""
EXPORT_MARKERS = ("model_index.json",)
"""Files that make a folder an export of finished weights (a diffusers pipeline), not a checkpoint."""
EXPORT_NAMES = re.compile(r"^(final|final_model|export|exported|pipeline|best_model)$", re.IGNORECASE)
"""Folder names of a final export beside the checkpoints (a copy of the last step)."""


WRAPPER_PREFIXES = ("_orig_mod.", "module.")
"""Prefixes a wrapper puts on every key (``torch.compile``'s ``_orig_mod.``, DDP's ``module.``)."""
DDP_PREFIX, COMPILE_PREFIX = "module.", "_orig_mod."


@dataclass(frozen=True, slots=True)
class Saver:
    """Who wrote a single file, by its top level, and which wrapper prefixes its loader takes off.

    ``marks``: alternatives, each of entries (``state.model``) that must all be in the file (none:
    any file). ``drops``: the prefixes taken off every key. ``deepest``: how many containers deep
    the state dict may sit for them still to be dropped. ``why``: one clause for ``inspect``.
    """

    name: str
    marks: tuple[tuple[str, ...], ...]
    drops: tuple[str, ...]
    deepest: int
    why: str

    def recognises(self, root: Any) -> bool:
        """Whether ``root`` (a file's unpickled top level) has one of :attr:`marks`."""
        return not self.marks or any(all(_has(root, entry.split(".")) for entry in alternative)
                                     for alternative in self.marks)


def _has(root: Any, parts: Sequence[str]) -> bool:
    for part in parts:
        if not isinstance(root, dict) or part not in root:
            return False
        root = root[part]
    return True


SAVERS: tuple[Saver, ...] = (
    Saver("Lightning", (("pytorch-lightning_version",), ("state_dict", "loops")), (), 0,
          "a Lightning checkpoint: load_from_checkpoint loads its state_dict with these names "
          "(an attribute named module keeps its prefix)"),
    Saver("Composer", (("state.model", "state.timestamp"),), (), 0,
          "a Composer checkpoint: Composer loads state.model with these names (ComposerModel keeps the "
          "network as its attribute module; DDP's own prefix is gone before it saves)"),
    Saver("nanoGPT", (("model_args", "iter_num"),), (COMPILE_PREFIX,), 1,
          "a nanoGPT-style checkpoint: its sample.py strips torch.compile's _orig_mod."),
    Saver("a plain training loop", (), (COMPILE_PREFIX, DDP_PREFIX), 1,
          "a plain training loop's state dict (the file itself, or one container of it): DDP's module. and "
          "torch.compile's _orig_mod. wrap every key, and loading code strips them"),
)
"""Who writes single files, first match wins (the last row: any file)."""


CARRIED_NAMES = ("config.json", "generation_config.json", "adapter_config.json", "metadata.json", "common.pt",
                 "meta.pt")
"""Files beside the weights that trainers' loaders read with them (Hugging Face's configs,
megatron-core's ``metadata.json`` and ``common.pt``, Lightning's ``meta.pt``), carried byte for byte."""
