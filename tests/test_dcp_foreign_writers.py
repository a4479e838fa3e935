"""DCP checkpoints written by a trainer's own ``StorageWriter``, whose ``.metadata`` pickles the
trainer's own copy of torch's private ``filesystem._StorageInfo`` (OLMo-core's
``RemoteFileSystemWriter`` does): read by the record's shape, the class never imported.

Every checkpoint here is written by ``torch.distributed.checkpoint.save`` through a real
subclass of torch's ``FileSystemWriter`` that hands back its own storage records, of classes
defined in packages written under a temporary folder (``olmo_core.distributed.checkpoint.filesystem``
and others). Once written, and once torch's own ``dcp.load`` has read them with those classes
importable (the oracle), every module is replaced by one whose import leaves a marker and
raises, and stays on ``sys.path``: a reader that imported one would fail or leave the marker.

The variants:

- ``olmo``: a dataclass of torch's four fields (``transform_descriptors`` pickled as None);
- ``plain``: a plain class of three fields, no ``transform_descriptors`` at all;
- ``extra``: a dataclass with a field more (``base_offset``): refused naming it, since a field we
  do not understand could change where the bytes lie, and reading past it would read wrong bytes
  without a word;
- ``badtype``: the right fields, ``offset`` a string: refused in one line naming the file;
- ``transformed``: the ``olmo`` class with ``transform_descriptors=["stream.zstd/1"]``: refused
  as torch's own transformed records are;
- ``runinfo``: torch's own records, but a class of the trainer's (``run_meta.records.RunInfo``)
  tacked onto the metadata: refused, offering ``--inert-global``, which then reads it.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.futures import Future
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.errors import CheckpointFormatError, UnsafePickleError
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.formats.dcp import metadata_unpickle
from ema_ckpt.formats.dcp.reader import DcpReader
from ema_ckpt.formats.options import ReadOptions
from ema_ckpt.layout import Box
from ema_ckpt.maths import ExponentialProfile
from tests.ema_reference import assert_close_relative, reference_ema

runner = CliRunner()

_DATACLASS = '''
import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
{more}
'''
_PLAIN = '''
class _StorageInfo:
    transform_descriptors = None  # a class attribute (torch's reader asks for it): never in the pickle

    def __init__(self, relative_path, offset, length):
        self.relative_path = relative_path
        self.offset = offset
        self.length = length
'''
_RUN_INFO = '''
import dataclasses


@dataclasses.dataclass
class RunInfo:
    run: str
    world_size: int
'''
MODULES = {  # module: its source
    "olmo_core.distributed.checkpoint.filesystem": _DATACLASS.format(
        more="    transform_descriptors: Optional[Sequence[str]] = None"),
    "other_trainer.checkpoint.storage": _PLAIN,
    "extra_trainer.checkpoint": _DATACLASS.format(
        more="    transform_descriptors: Optional[Sequence[str]] = None\n    base_offset: int = 0"),
    "bad_trainer.checkpoint": _DATACLASS.format(
        more="    transform_descriptors: Optional[Sequence[str]] = None"),
    "run_meta.records": _RUN_INFO,
}
# variant: (module of its storage record class or None for torch's, how a record is made from torch's)
VARIANTS: dict[str, tuple[str | None, Any]] = {
    "olmo": ("olmo_core.distributed.checkpoint.filesystem",
             lambda cls, i: cls(i.relative_path, i.offset, i.length, i.transform_descriptors)),
    "plain": ("other_trainer.checkpoint.storage", lambda cls, i: cls(i.relative_path, i.offset, i.length)),
    "extra": ("extra_trainer.checkpoint", lambda cls, i: cls(i.relative_path, i.offset, i.length, None, 0)),
    "badtype": ("bad_trainer.checkpoint", lambda cls, i: cls(i.relative_path, str(i.offset), i.length)),
    "transformed": ("olmo_core.distributed.checkpoint.filesystem",
                    lambda cls, i: cls(i.relative_path, i.offset, i.length, ["stream.zstd/1"])),
    "runinfo": (None, None),
}
ACCEPTED = ["olmo", "plain"]
STEPS = [1, 2]
RUN_INFO = "run_meta.records.RunInfo"


class ForeignWriter(FileSystemWriter):
    """torch's ``FileSystemWriter``, handing back its own storage records (``record(cls, info)``,
    ``cls`` from ``module``) in place of torch's ``_StorageInfo``, as a trainer's writer does."""

    def __init__(self, path: Path, module: str | None, record: Any, **kwargs: Any) -> None:
        super().__init__(path, sync_files=False, **kwargs)
        self._module, self._record = module, record

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()
        if self._module is not None:
            cls = importlib.import_module(self._module)._StorageInfo
            results = [dataclasses.replace(r, storage_data=self._record(cls, r.storage_data)) for r in results]
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Any, results: Any) -> None:
        if self._module is None:  # a trainer's record of its own, tacked onto the metadata
            metadata.run_info = importlib.import_module("run_meta.records").RunInfo("run-7", 8)
        super().finish(metadata, results)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "fc.weight": torch.randn(6, 4, generator=g),
            "fc.bias": torch.randn(6, generator=g).to(torch.bfloat16),
            "norm.running_count": torch.tensor(10 * step),
        },
        "optim": {"param_groups": [{"lr": 0.1 * step}]},  # a bytes entry
        "step": step,
    }


def _empty_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    return state


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[prefix + key] = value
    return flat


def _write_modules(root: Path, source_of: dict[str, str]) -> None:
    for module, source in source_of.items():
        parts = module.split(".")
        for i in range(1, len(parts)):
            package = root.joinpath(*parts[:i])
            package.mkdir(parents=True, exist_ok=True)
            (package / "__init__.py").touch()
        root.joinpath(*parts[:-1], parts[-1] + ".py").write_text(textwrap.dedent(source))


def _forget_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in {m.split(".")[0] for m in MODULES}:
            del sys.modules[name]


@dataclass
class Made:
    root: Path
    packages: Path
    marker: Path
    oracle: dict[tuple[str, int], dict[str, torch.Tensor]]  # (variant, step): torch's dcp.load

    def ckpt(self, variant: str, step: int = STEPS[-1]) -> Path:
        return self.root / variant / f"step_{step}"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Made:
    root = tmp_path_factory.mktemp("foreign_writers")
    packages, marker = root / "packages", root / "imported"
    _write_modules(packages, MODULES)
    sys.path.insert(0, str(packages))
    importlib.invalidate_caches()
    oracle = {}
    try:
        for variant, (module, record) in VARIANTS.items():
            for step in STEPS:
                path = root / variant / f"step_{step}"
                dcp.save(_state(step), storage_writer=ForeignWriter(path, module, record), no_dist=True)
                if variant in ACCEPTED:  # torch reads it with the real class importable
                    target = _empty_like(_state(step))
                    dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
                    oracle[(variant, step)] = _flat(target)
        assert "olmo_core.distributed.checkpoint.filesystem" in sys.modules  # the oracle did import it
    finally:
        sys.path.remove(str(packages))
        _forget_modules()
    # from here on, importing any of these modules leaves the marker and fails
    poison = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nraise ImportError('imported ' + __name__)\n"
    _write_modules(packages, dict.fromkeys(MODULES, poison))
    for cache in packages.rglob("__pycache__"):
        shutil.rmtree(cache)
    return Made(root, packages, marker, oracle)


@pytest.fixture(autouse=True)
def importable(made, monkeypatch):
    """The (poisoned) modules stay on ``sys.path`` during every test: none may be imported."""
    monkeypatch.syspath_prepend(str(made.packages))
    yield
    assert not made.marker.exists(), made.marker.read_text()
    assert not [m for m in sys.modules if m.split(".")[0] in {n.split(".")[0] for n in MODULES}]


@pytest.fixture(params=["c", "lean"])
def unpickler(request, monkeypatch) -> str:
    """Through the C unpickler and through the lean one (large metadata)."""
    if request.param == "lean":
        monkeypatch.setattr(metadata_unpickle, "_LEAN_ABOVE", 0)
    return str(request.param)


def _read_all(path: Path, **options: Any) -> dict[str, torch.Tensor]:
    with open_checkpoint(path, read=ReadOptions(**options)) as reader:
        return {k: reader.read(k, Box.full(s.shape)) for k, s in reader.specs().items()}


def _one_line_error(result: Any) -> str:
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


# --- accepted: read by shape, equal to torch's dcp.load ----------------------------------------------


@pytest.mark.parametrize("variant", ACCEPTED)
def test_a_foreign_storage_record_is_read_as_torchs(made, unpickler, variant):
    for step in STEPS:
        want = made.oracle[(variant, step)]
        got = _read_all(made.ckpt(variant, step))
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    # the same index as a checkpoint torch's own writer saves
    with DcpReader(made.ckpt(variant)) as reader:
        assert sorted(reader.non_tensor_keys) == ["optim.param_groups.0.lr", "step"]
        assert {file for file, _, _ in reader.stored_records()} == {"__0_0.distcp"}


def test_the_metadata_names_the_trainers_class_and_torch_would_import_it(made):
    data = (made.ckpt("olmo") / ".metadata").read_bytes()
    assert b"olmo_core.distributed.checkpoint.filesystem" in data and b"_StorageInfo" in data
    assert b"torch.distributed.checkpoint.filesystem" not in data
    with pytest.raises(ImportError, match="imported olmo_core"):  # torch's plain pickle.load imports it
        pickle.loads(data)
    made.marker.unlink()
    _forget_modules()


def test_the_class_module_is_never_imported(made, unpickler):
    for variant in ACCEPTED:
        _read_all(made.ckpt(variant))
        assert runner.invoke(app, ["inspect", str(made.ckpt(variant))]).exit_code == 0
    assert not made.marker.exists()
    assert "olmo_core.distributed.checkpoint.filesystem" not in sys.modules
    assert "other_trainer.checkpoint.storage" not in sys.modules


@pytest.mark.parametrize("variant", ACCEPTED)
def test_inspect_and_accumulate_from_the_command_line(made, tmp_path, variant):
    result = runner.invoke(app, ["inspect", str(made.ckpt(variant))])
    assert result.exit_code == 0, result.output
    assert "model.fc.weight" in result.output
    out = tmp_path / "ema"
    result = runner.invoke(app, ["accumulate", str(made.root / variant), "--decay", "0.5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    model = [{k: v for k, v in made.oracle[(variant, s)].items() if k.startswith("model.")} for s in STEPS]
    want = reference_ema(model, STEPS, ExponentialProfile(0.5).keep_factor)
    got = _read_all(out)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_close_relative(got[key], value)


# --- refused: a shape we do not understand, a value of the wrong type ---------------------------------


def test_an_extra_field_is_refused_naming_it(made, unpickler):
    with pytest.raises(CheckpointFormatError, match=r"\(a record of class extra_trainer\.checkpoint\._StorageInfo\) "
                                                    r"has a field torch's _StorageInfo does not have, 'base_offset': "
                                                    r"it could change where the bytes lie"):
        open_checkpoint(made.ckpt("extra"))
    line = _one_line_error(runner.invoke(app, ["inspect", str(made.ckpt("extra"))]))
    assert "'base_offset'" in line and str(made.ckpt("extra") / ".metadata") in line


def test_a_value_of_the_wrong_type_is_refused_in_one_line_naming_the_file(made, unpickler):
    line = _one_line_error(runner.invoke(app, ["inspect", str(made.ckpt("badtype"))]))
    assert str(made.ckpt("badtype") / ".metadata") in line
    assert re.search(r"has offset '\d+' \(a str\), not an integer", line)
    assert "(a record of class bad_trainer.checkpoint._StorageInfo)" in line
    result = runner.invoke(app, ["accumulate", str(made.root / "badtype"), "--decay", "0.5",
                                 "--out", str(made.root / "badtype-ema")])
    assert result.exit_code == 3 and "Traceback" not in result.output, result.output


def test_transformed_records_of_a_foreign_class_are_refused_as_torchs_are(made):
    with pytest.raises(CheckpointFormatError, match=r"transformed records \(\['stream\.zstd/1'\]\) are not supported"):
        open_checkpoint(made.ckpt("transformed"))


# --- a class of the trainer's anywhere else: refused, offering --inert-global --------------------------


def test_an_unknown_class_is_refused_offering_inert_global_not_skip_damaged(made, unpickler):
    path = made.ckpt("runinfo")
    with pytest.raises(UnsafePickleError) as caught:
        open_checkpoint(path)
    message = str(caught.value)
    assert message.startswith(f"{path / '.metadata'}: refers to {RUN_INFO} in the metadata's 'run_info', which is "
                              "not allowed; nothing from the file was run"), message
    assert f"pass inert_globals={RUN_INFO}" in message
    for args in (["inspect", str(path)],
                 ["accumulate", str(made.root / "runinfo"), "--decay", "0.5", "--out", str(made.root / "ri-ema")]):
        line = _one_line_error(runner.invoke(app, args))
        assert f"refers to {RUN_INFO}" in line and str(path.parent) in line
        assert f"pass --inert-global {RUN_INFO} (or 'run_meta.records.*') to read it as inert data" in line
        assert "--skip-damaged" not in line and "skip" not in line


def test_inert_global_reads_a_dcp_metadata_with_that_class(made, tmp_path, unpickler):
    path = made.ckpt("runinfo")
    got = _read_all(path, inert_globals=(RUN_INFO,))
    assert sorted(got) == sorted(_flat(_state(STEPS[-1])))
    assert torch.equal(got["model.fc.weight"], _state(STEPS[-1])["model"]["fc.weight"])
    assert runner.invoke(app, ["inspect", str(path), "--inert-global", "run_meta.*"]).exit_code == 0
    result = runner.invoke(app, ["accumulate", str(made.root / "runinfo"), "--decay", "0.5", "--out",
                                 str(tmp_path / "ema"), "--inert-global", RUN_INFO])
    assert result.exit_code == 0, result.output


def test_the_flag_does_not_loosen_the_shape_of_a_storage_record(made):
    with pytest.raises(CheckpointFormatError, match="'base_offset'"):
        _read_all(made.ckpt("extra"), inert_globals=("extra_trainer.*",))


# --- the rules, on pickles made here ----------------------------------------------------------------


@dataclass
class _StorageInfo:  # a trainer's record, pickled by this module's name
    relative_path: str
    offset: int
    length: int


class RunInfo:
    pass


def _metadata(tmp_path: Path) -> Any:
    path = tmp_path / f"ck{len(list(tmp_path.iterdir()))}"
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)
    with open(path / ".metadata", "rb") as handle:
        return pickle.load(handle)


def _load(metadata: Any, **options: Any) -> Any:
    return metadata_unpickle.load_dcp_metadata_bytes(pickle.dumps(metadata, protocol=4), "x/.metadata",
                                                     ReadOptions(**options).inert_globals)


def test_a_storage_shaped_record_elsewhere_is_refused(tmp_path, unpickler):
    metadata = _metadata(tmp_path)
    (index, info), = metadata.storage_data.items()
    metadata.storage_data[index] = _StorageInfo(info.relative_path, info.offset, info.length)
    assert _load(metadata).storage_data  # where torch puts it: read
    metadata.state_dict_metadata["w"] = _StorageInfo("x", 0, 1)  # as a tensor's entry: refused
    with pytest.raises(UnsafePickleError, match=rf"refers to {__name__}\._StorageInfo under key 'w'"):
        _load(metadata)
    metadata = _metadata(tmp_path)
    shared = _StorageInfo(info.relative_path, info.offset, info.length)
    metadata.storage_data[index] = shared
    metadata.version = shared  # at its place and elsewhere too
    with pytest.raises(UnsafePickleError, match=r"in the metadata's 'version'"):
        _load(metadata)


def test_a_class_object_as_a_value_and_a_call_are_refused(tmp_path, unpickler):
    metadata = _metadata(tmp_path)
    metadata.planner_data = {"w": RunInfo}  # the class itself
    with pytest.raises(UnsafePickleError, match=rf"refers to {__name__}\.RunInfo in the metadata's 'planner_data'"):
        _load(metadata)
    assert _load(metadata, inert_globals=(f"{__name__}.RunInfo",)).planner_data
    with pytest.raises(UnsafePickleError, match=r"builtins\.print is called, not data"):
        metadata_unpickle.load_dcp_metadata_bytes(pickle.dumps(_Call(print, ("x",))), "x/.metadata")


class _Call:
    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def test_a_record_made_by_a_call_or_of_code_is_not_read_by_shape(tmp_path, unpickler):
    metadata = _metadata(tmp_path)
    (index, info), = metadata.storage_data.items()
    metadata.storage_data[index] = _Call(_StorageInfo, (info.relative_path, info.offset, info.length))
    with pytest.raises(UnsafePickleError, match=rf"refers to {__name__}\._StorageInfo, which is not allowed.*"
                                                "pass inert_globals="):
        _load(metadata)
    with pytest.raises(CheckpointFormatError, match="was made by a call"):  # listed: recorded, still not read by shape
        _load(metadata, inert_globals=(f"{__name__}.*",))
