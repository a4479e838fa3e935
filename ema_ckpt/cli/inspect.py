"""``ema-ckpt inspect``: what a checkpoint holds, from metadata alone."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from ..storage import as_path
from ._errors import reports_errors
from ._flags import cli_text
from ._options import InertGlobalOpt, JsonOpt, KeepPrefixOpt, StateKeyOpt, StepFromOpt, library_args
from ._output import console, exact_bytes, human_bytes, print_json, shown
from ._tables import Name, name_table, summary_grid

if TYPE_CHECKING:
    from ..commands.inspect import FolderInspection, InspectResult

EPILOG = """\
Examples:

  ema-ckpt inspect ckpts/step_1000

  ema-ckpt inspect ckpts/ema --json | jq .manifest

  ema-ckpt inspect ckpts/                      # a folder: what is taken, what is left, and why

  ema-ckpt inspect last.pth.tar --state-key state_dict_ema

The summary shows each fact once; --json holds everything the format records. A single file
also shows its top-level entries and which one holds the model.
"""
MAX_ROWS = 40
MAX_ITEMS = 8
"""A list in the summary (file names, non-tensor keys) shows this many items without --all."""

InspectWorkersOpt = Annotated[
    int,
    typer.Option("--workers", "-j", min=1, metavar="N",
                 help="Accepted as by every command; inspect reads metadata only, so there is nothing to split."),
]

_LABELS = {
    "total_bytes": "file size",
    "metadata": "header metadata",
    "index_metadata": "index metadata",
    "rank_local_metadata": "rank-local metadata",
    "non_tensor_keys": "non-tensor keys",
    "keys_sharing_storage": "keys sharing a storage",
    "dtype": "training dtype",
    "ds_version": "DeepSpeed version",
    "global_step": "global step",
}
_BYTES = re.compile(r"(^|_)(bytes|total_size)$")  # detail names whose integers count bytes
_STEPS = re.compile(r"step|iter|epoch")


def fact(name: str, value: Any, *, all_items: bool = False) -> str | None:
    """A detail's value as text, or None when it says nothing (None, empty, off, zero).

    Example:
        >>> fact("total_bytes", 419288), fact("metadata", {"format": "pt"}), fact("index", None)
        ('409.5 KiB (419,288 bytes)', 'format pt', None)
    """
    if value is None or value is False or (isinstance(value, (str, list, tuple, dict)) and not value):
        return None
    if value is True:
        return "yes"
    if isinstance(value, int):
        if value == 0:
            return None
        if _BYTES.search(name):
            return exact_bytes(value)
        # steps are names (step_1000), never written 1,000
        return str(value) if _STEPS.search(name) else f"{value:,}"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, Mapping) and name.endswith("metadata") and len(value) > MAX_ITEMS:
        # a training script's own metadata (kohya's ss_* keys): its names here, its values in --json
        names = [shown(k) for k in value]
        return f"{len(names)} entries: " + ", ".join(names if all_items else names[:MAX_ITEMS]) + (
            "" if all_items else ", … (--json shows the values)")
    if isinstance(value, Mapping):
        parts = [(shown(k), fact(str(k), v, all_items=all_items)) for k, v in value.items()]
        return ", ".join(f"{k} {v}" for k, v in parts if v is not None) or None
    if isinstance(value, (list, tuple)):
        items = [text for v in value if (text := fact(name, v, all_items=all_items)) is not None]
        if not all_items and len(items) > MAX_ITEMS:
            return ", ".join(items[:MAX_ITEMS]) + f", … ({len(items)} in all; --all lists them)"
        return ", ".join(items) or None
    return shown(value)


def _said_already(report: InspectResult, name: str, value: Any) -> bool:
    """Whether a detail repeats a row of the summary (format, step, keys, dtypes, path)."""
    details = report.details
    core: dict[str, Any] = {"format": report.format_name, "tensors": report.key_count, "keys": report.key_count,
                            "dtypes": report.dtypes, "file": report.path.name}
    if name in ("step", "global_step", "tree"):
        return True  # the summary's step row, with its record (counters: every other); the tree: its own table
    if name in core:
        return bool(value == core[name])
    if name == "indexed":
        return "index" in details  # the index row names the file
    if name == "tag_dir" and isinstance(value, str):
        return as_path(value) in {report.path, report.path / str(details.get("tag")), report.model_path}
    if name == "top_level" and isinstance(value, list):
        if report.container and value == [report.container.removesuffix(".")]:
            return True  # the container row names it
        return len(value) >= report.key_count  # a flat state dict: every key is its own top level
    return False


def summary_rows(report: InspectResult, *, all_items: bool = False) -> list[tuple[str, str]]:
    """The summary above the key table: each fact once, as text.

    Example:
        >>> rows = summary_rows(inspect_checkpoint("ema.safetensors"))    # doctest: +SKIP
        >>> dict(rows)["tensor data"]                                     # doctest: +SKIP
        '407.1 KiB (416,832 bytes)'
    """
    rows = [("path", shown(report.path)), ("format", report.format_name)]
    if report.trainer is not None and report.model_path is not None:
        rows.append(("model", f"{shown(report.model_path)} (nested by {report.trainer})"))
    if report.step is None:
        rows.append(("step", "unknown" + (f": {cli_text(report.step_source)}" if report.step_source else "")))
    else:
        rows.append(("step", f"{report.step} (from {cli_text(report.step_source or '')})"))
    rows.append(("keys", f"{report.key_count:,}"))
    rows.append(("tensor data", exact_bytes(report.total_bytes)))
    rows.append(("dtypes", ", ".join(f"{d} ×{n:,}" for d, n in sorted(report.dtypes.items()))))
    for name, value in report.details.items():
        if _said_already(report, name, value):
            continue
        text = fact(name, value, all_items=all_items)
        if text is not None:
            rows.append((_LABELS.get(name, name.replace("_", " ")), text))
    if report.counters:
        rows.append(("counters", ", ".join(f"{c['record']} = {c['value']} ({c['counts']}"
                                           + (", taken)" if c.get("taken") else ")") for c in report.counters)))
    if report.container:
        rows.append(("container", f"{shown(report.container)} (consolidate writes the keys without it)"))
    rows += [("note", cli_text(line)) for line in report.notes]
    if report.manifest:
        m = report.manifest
        rows.append(("ema-ckpt", f"{m['kind']}: {m['description']}, in {m['dtype']}, "
                                 f"{m['checkpoints']:,} checkpoints folded, at step {m['step']}"))
    return rows


@reports_errors
def inspect_command(
    path: Annotated[str, typer.Argument(help="A checkpoint directory (or file).")],
    all_keys: Annotated[
        bool, typer.Option("--all", help=f"List every key (default: the first {MAX_ROWS}) and every listed name.")
    ] = False,
    json_output: JsonOpt = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print nothing; the exit code says whether the checkpoint reads.")
    ] = False,
    state_key: StateKeyOpt = None,
    step_from: StepFromOpt = None,
    keep_prefix: KeepPrefixOpt = False,
    inert_global: InertGlobalOpt = None,
    workers: InspectWorkersOpt = 1,
) -> None:
    """Show format, step, keys, dtypes, bytes and chunk layout (reads no tensor)."""
    args = library_args(locals(), "all_keys", "workers")
    # here: the library loads on use, so --help and --version stay fast
    from ..commands.inspect import inspect_checkpoint, inspect_folder, is_folder_of_checkpoints

    if is_folder_of_checkpoints(path):
        folder = inspect_folder(**args)
        if json_output:
            print_json(folder.to_dict())
        elif not quiet:
            render_folder(folder, all_rows=all_keys)
        return
    report = inspect_checkpoint(**args)
    if json_output:
        print_json(report.to_dict(streamed=True))
    if json_output or quiet:
        return
    summary = summary_grid()
    for label, value in summary_rows(report, all_items=all_keys):
        summary.add_row(label, Name(value))
    console.print(summary)
    tree = report.details.get("tree")
    if tree:
        entries = name_table("in the file", "holds", "read as")
        for row in tree:
            entries.add_row(Name(row["key"]), row["holds"], row["role"] or "-")
        console.print(entries)
    table = name_table("key", "shape", "dtype", "bytes", "chunks", right={"bytes", "chunks"})
    rows = report.tensors if all_keys else report.tensors[:MAX_ROWS]
    for t in rows:
        table.add_row(Name(t.key), "×".join(map(str, t.shape)) or "scalar", t.dtype, human_bytes(t.nbytes),
                      f"{t.chunks:,}")
    console.print(table)
    if len(rows) < len(report.tensors):
        console.print(f"… {len(report.tensors) - len(rows):,} more keys (--all lists them)", style="dim")


def render_folder(folder: FolderInspection, *, all_rows: bool = False) -> None:
    """A folder of checkpoints: each entry, taken (with its step) or left, and why."""
    taken = folder.taken
    console.print(f"{shown(folder.path)}: {len(taken):,} checkpoint{'s' if len(taken) != 1 else ''} "
                  f"of {len(folder.entries):,} entries", highlight=False)
    rows = folder.entries if all_rows else folder.entries[:MAX_ROWS]
    table = Table(show_edge=False)
    table.add_column("entry", overflow="fold", min_width=min(24, max((len(e.path.name) for e in rows), default=5)))
    table.add_column("taken", no_wrap=True, min_width=5)
    table.add_column("step", no_wrap=True, justify="right", min_width=4)
    table.add_column("why", overflow="fold", ratio=1)
    for entry in rows:
        why = cli_text(entry.why).replace(f"{folder.path}/", "")  # entries beside it, by name
        table.add_row(Name(entry.path.name), "yes" if entry.taken else "no",
                      str(entry.step) if entry.step is not None else "-", why)
    console.print(table)
    if len(rows) < len(folder.entries):
        console.print(f"… {len(folder.entries) - len(rows):,} more entries (--all lists them)", style="dim")
    for line in folder.notes:
        console.print(cli_text(line), style="dim", highlight=False)
    for entry in rows:
        if entry.components:
            parts = ", ".join(f"{c.name or '(own)'} ({c.format_name}, {c.role})" for c in entry.components)
            console.print(f"{entry.path.name}: components {parts}", style="dim", highlight=False)
