"""Conformance of the private torch, CPython and gcsfs behaviour ema-ckpt relies on (ema_ckpt/_compat,
formats/dcp/metadata_pickle.py, storage/object_clients.py's bounded GCS requests).

Each test here fails when the installed torch, Python or gcsfs changes a behaviour one of the
modules relies on: the message names what changed, and the module's docstring says what to
update.
"""

from __future__ import annotations

import _compat_pickle
import ast
import collections
import dataclasses
import enum
import gc
import inspect
import io
import pickle
import pickletools
import subprocess
import sys
import textwrap
import warnings
import weakref
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ema_ckpt import _gc
from ema_ckpt._compat import torch_load
from ema_ckpt.formats.dcp import metadata_layout as layout_check
from ema_ckpt.formats.dcp import metadata_pickle as compat
from ema_ckpt.formats.dcp.metadata_unpickle import check_written_metadata, load_dcp_metadata_bytes
from ema_ckpt.formats.dcp.writer import DcpWriter
from ema_ckpt.layout import Box

# --- DCP .metadata: the emitter against the installed torch -----------------------------------

_TENSORS = {
    "model.w": ("float32", (4, 2), [((0, 0), (2, 2), ("__0_0.distcp", 0, 100)),
                                    ((2, 0), (2, 2), ("__1_0.distcp", 0, 100))]),
    "model.scalar": ("bfloat16", (), [((), (), ("__0_0.distcp", 100, 50))]),
    "model.empty": ("int64", (0, 3), [((0, 0), (0, 3), None)]),
    "model.ключ": ("float8_e4m3fn", (1 << 33,), [((0,), (1 << 33,), ("__1_0.distcp", 1 << 35, 1 << 33))]),
}
_BLOBS = {"step": ("__0_0.distcp", 150, 12)}
_PLANNER = {"model.w": ("model", "w"), "model.scalar": ("model", "scalar"), "step": ("step",)}


def _torchs_metadata() -> dcp_metadata.Metadata:
    """What torch's own classes hold for the checkpoint described by _TENSORS and _BLOBS."""
    state: dict = {}
    storage: dict = {}
    for key, (dtype, shape, chunks) in _TENSORS.items():
        state[key] = dcp_metadata.TensorStorageMetadata(
            dcp_metadata.TensorProperties(dtype=getattr(torch, dtype)), torch.Size(shape),
            [dcp_metadata.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in chunks])
        for index, (offsets, _sizes, record) in enumerate(chunks):
            if record is not None:
                storage[dcp_metadata.MetadataIndex(key, offsets, index)] = filesystem._StorageInfo(*record)
    for key, record in _BLOBS.items():
        state[key] = dcp_metadata.BytesStorageMetadata()
        storage[dcp_metadata.MetadataIndex(key)] = filesystem._StorageInfo(*record)
    planner = {key: tuple(_PLANNER.get(key, (key,))) for key in state}
    return dcp_metadata.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                                 version="1.0.0")


def _structure(value: object) -> object:
    """Everything about ``value`` that torch could tell apart: types, fields in declaration
    order, the attributes actually set, the index hints equality ignores."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return (cls.__module__, cls.__qualname__, sorted(vars(value)),
                [(f.name, _structure(getattr(value, f.name))) for f in dataclasses.fields(cls)])
    if isinstance(value, dict):
        return ("dict", [(_structure(k), _structure(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__qualname__, [_structure(item) for item in value])
    if isinstance(value, enum.Enum):
        return (type(value).__qualname__, value.name, value.value)
    return (type(value).__qualname__, value)


def _emitted() -> bytes:
    return compat.dump_metadata(_TENSORS, _BLOBS, _PLANNER)


def test_the_installed_torch_defines_what_the_emitter_mirrors():
    found = layout_check.installed_layout()
    changed = {name: (found[name], want) for name, want in layout_check.EXPECTED_LAYOUT.items()
               if found[name] != want}
    assert not changed, f"update ema_ckpt/formats/dcp/metadata_layout.py (found, expected): {changed}"
    assert layout_check.emitter_matches_torch.__wrapped__() is True


def test_the_source_reader_agrees_with_torchs_live_classes():
    """The check reads torch's source; what it reads is what the imported classes are."""
    modules = {"metadata": dcp_metadata, "filesystem": filesystem}
    for qualified, layout in layout_check.EXPECTED_LAYOUT.items():
        module_name, name = qualified.split(".")
        live = getattr(modules[module_name], name)
        if isinstance(layout, str):
            assert live == layout, qualified
            continue
        assert live.__module__ == modules[module_name].__name__, f"{qualified} moved to {live.__module__}"
        names = [field.split("=")[0] for field in layout.fields]
        if issubclass(live, enum.Enum):
            assert [f"{m.name}={m.value}" for m in live] == list(layout.fields), qualified
            continue
        assert [f.name for f in dataclasses.fields(live)] == names, qualified
        for hook in ("__setstate__", "__getstate__", "__reduce__", "__reduce_ex__", "__new__"):
            assert (hook in vars(live)) == (hook in layout.hooks), (qualified, hook)
    index = {f.name: f for f in dataclasses.fields(dcp_metadata.MetadataIndex)}["index"]
    assert index.compare is False and index.hash is False


def test_emitted_bytes_unpickle_to_what_torch_itself_pickles():
    ours = pickle.loads(_emitted())
    built = _torchs_metadata()
    theirs = pickle.loads(pickle.dumps(built))  # what torch's own save and load give back
    assert ours == built
    assert _structure(ours) == _structure(theirs)
    assert [(i.fqn, i.offset, i.index) for i in ours.storage_data] == [
        (i.fqn, i.offset, i.index) for i in built.storage_data]
    for value in ours.state_dict_metadata.values():
        if isinstance(value, dcp_metadata.TensorStorageMetadata):
            assert value.properties.memory_format is torch.contiguous_format
            assert value.properties.layout is torch.strided


def _globals_named(data: bytes) -> set[tuple[str, str]]:
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            named.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return named


def test_emitted_bytes_name_the_globals_torchs_pickle_names():
    assert _globals_named(_emitted()) == _globals_named(pickle.dumps(_torchs_metadata(), protocol=4))


def test_a_changed_or_missing_torch_definition_is_noticed(monkeypatch):
    real = layout_check._torch_source

    def renamed(module: str) -> str:
        return real(module).replace("    relative_path: str", "    path: str")

    monkeypatch.setattr(layout_check, "_torch_source", renamed)
    assert layout_check.installed_layout()["filesystem._StorageInfo"].fields[0] == "path"
    assert layout_check.emitter_matches_torch.__wrapped__() is False

    def missing(module: str) -> str:
        raise FileNotFoundError(module)

    monkeypatch.setattr(layout_check, "_torch_source", missing)
    assert layout_check.emitter_matches_torch.__wrapped__() is False


def test_the_check_runs_once_only_when_metadata_is_written_and_imports_no_dcp(tmp_path):
    code = textwrap.dedent(f"""
        import pathlib, sys, time, torch
        import ema_ckpt.cli, ema_ckpt.formats.dcp.writer
        from ema_ckpt.formats.dcp.metadata_pickle import emitter_matches_torch
        from ema_ckpt.layout import Box
        assert emitter_matches_torch.cache_info().misses == 0, "checked before any DCP output"
        for name in ("a", "b"):
            w = ema_ckpt.formats.dcp.writer.DcpWriter(pathlib.Path({str(tmp_path)!r}) / name)
            w.declare("w", (2,), torch.float32)
            w.write("w", Box((0,), (2,)), torch.ones(2))
            w.finish()
        info = emitter_matches_torch.cache_info()
        assert (info.misses, info.hits) == (1, 1), info
        assert "torch.distributed.checkpoint" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_fallback_pickles_the_same_metadata_with_torchs_classes(monkeypatch):
    emitted = _emitted()
    monkeypatch.setattr(compat, "emitter_matches_torch", lambda: False)
    fallback = _emitted()
    assert fallback != emitted  # it really is torch's pickler
    assert _structure(pickle.loads(fallback)) == _structure(pickle.loads(emitted))
    assert fallback == _emitted()  # a function of the values only, like the emitter's
    check_written_metadata(fallback, len(_TENSORS) + len(_BLOBS))
    inert = load_dcp_metadata_bytes(fallback, "x")
    assert list(inert.state_dict_metadata) == list(_TENSORS) + list(_BLOBS)


def _write_checkpoint(path: Path) -> None:
    w = DcpWriter(path)
    w.declare("model.w", (4, 3), torch.float32)
    w.write("model.w", Box((0, 0), (2, 3)), torch.arange(6.0).reshape(2, 3), rank=0)
    w.write("model.w", Box((2, 0), (2, 3)), -torch.arange(6.0).reshape(2, 3), rank=1)
    w.declare("model.h", (5,), torch.bfloat16)
    w.write("model.h", Box((0,), (5,)), torch.ones(5, dtype=torch.bfloat16), rank=1)
    w.declare("model.none", (0, 2), torch.int64)
    w.write("model.none", Box((0, 0), (0, 2)), torch.zeros(0, 2, dtype=torch.int64))
    record = io.BytesIO()
    torch.save(7, record)
    w.write_bytes("step", record.getvalue())
    w.finish({"model.w": ("model", "w"), "model.h": ("model", "h"), "model.none": ("model", "none")})


def _loaded(path: Path) -> dict:
    state = {"model": {"w": torch.zeros(4, 3), "h": torch.zeros(5, dtype=torch.bfloat16),
                       "none": torch.zeros(0, 2, dtype=torch.int64)}, "step": 0}
    dcp.load(state, checkpoint_id=str(path))
    return state


def test_a_checkpoint_written_through_the_fallback_loads_like_the_emitters(tmp_path, monkeypatch):
    _write_checkpoint(tmp_path / "emitted")
    calls = []
    pickle_with_torch = compat._pickle_with_torch
    monkeypatch.setattr(compat, "emitter_matches_torch", lambda: False)
    monkeypatch.setattr(compat, "_pickle_with_torch", lambda *a: calls.append(1) or pickle_with_torch(*a))
    _write_checkpoint(tmp_path / "fallback")
    assert calls == [1]
    ours, theirs = _loaded(tmp_path / "emitted"), _loaded(tmp_path / "fallback")
    assert theirs["step"] == ours["step"] == 7
    for key in ours["model"]:
        assert torch.equal(ours["model"][key], theirs["model"][key]), key
    assert torch.equal(theirs["model"]["w"], torch.cat([torch.arange(6.0), -torch.arange(6.0)]).reshape(4, 3))
    read = [filesystem.FileSystemReader(str(tmp_path / name)).read_metadata()
            for name in ("emitted", "fallback")]
    for metadata in read:
        assert metadata.storage_meta.load_id  # set by the reader, a fresh id each time
        metadata.storage_meta = None
    assert _structure(read[0]) == _structure(read[1])
    for name in ("emitted", "fallback"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
    flat = [torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("emitted", "fallback")]
    assert flat[0].keys() == flat[1].keys() and flat[0]["step"] == 7
    for key in flat[0]["model"]:
        assert torch.equal(flat[0]["model"][key], flat[1]["model"][key]), key


# --- Ending the process: atexit._run_exitfuncs + os._exit ---------------------------------------

_EXITING = """
import atexit, sys
{prelude}
from ema_ckpt._compat.fast_exit import exit_now

class Teardown:
    def __del__(self):
        sys.stderr.write("teardown\\n")

alive_until_teardown = Teardown()
atexit.register(lambda: sys.stdout.write("registered first, run last\\n"))
atexit.register(lambda: sys.stdout.write("handler\\n"))
sys.stdout.write("x" * 100_000 + "\\n")  # a pipe: block-buffered, still in the buffer
exit_now({code})
"""


@pytest.mark.parametrize("fast", [True, False], ids=["os._exit", "without _run_exitfuncs"])
@pytest.mark.parametrize("code", [0, 3])
def test_exit_now_runs_the_handlers_flushes_the_output_and_keeps_the_code(fast, code):
    prelude = "" if fast else "del atexit._run_exitfuncs"
    script = _EXITING.format(prelude=prelude, code=code)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "x" * 100_000 + "\nhandler\nregistered first, run last\n"
    if fast:
        assert "teardown" not in proc.stderr  # the interpreter was not torn down
    assert "Traceback" not in proc.stderr


def test_exit_now_reports_output_lost_when_the_final_flush_fails(tmp_path):
    marker = tmp_path / "handler-ran"
    script = textwrap.dedent(f"""
        import atexit, io, pathlib, sys
        from ema_ckpt._compat.fast_exit import exit_now

        class FullDisk(io.RawIOBase):
            def writable(self):
                return True

            def write(self, data):
                raise OSError(28, "No space left on device")

        atexit.register(pathlib.Path({str(marker)!r}).touch)
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(FullDisk()))
        sys.stdout.write("lost")  # buffered: fails only when flushed
        exit_now(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 120 and marker.exists(), proc.stderr


def test_atexit_run_exitfuncs_runs_the_handlers_last_first_and_clears_them():
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stdout.write('first\\n'))\n"
        "atexit.register(lambda: sys.stdout.write('second\\n'))\n"
        "atexit._run_exitfuncs()\n"
        "sys.stdout.write('after\\n')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert proc.stdout == "second\nfirst\nafter\n"  # and not again at the real exit


# --- torch.load's private pieces: ema_ckpt._compat.torch_load -----------------------------------


def _saved_data_pkl(tmp_path: Path, obj: object) -> tuple[Path, bytes]:
    path = tmp_path / "saved.pt"
    torch.save(obj, path)
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        return path, zf.read(name)


def test_torchs_weights_only_allowlist_holds_what_the_fast_load_builds_on():
    allowed = torch_load.allowed_globals()
    assert allowed is not None, "torch._weights_only_unpickler._get_allowed_globals is gone: the fast load is off"
    rebuilds = torch_load.rebuild_functions()
    for name in (torch_load.REBUILD_TENSOR, torch_load.REBUILD_PARAMETER, torch_load.REBUILD_FROM_TYPE):
        assert allowed.get(name) is rebuilds[name], f"torch's allowlist no longer allows {name} as itself"
    for name, cls in (("collections.OrderedDict", collections.OrderedDict), ("torch.Size", torch.Size),
                      ("torch.device", torch.device)):
        assert allowed.get(name) is cls, name
    for name in ("torch.Tensor", "torch.nn.parameter.Parameter"):
        assert isinstance(allowed.get(name), type), name
    assert isinstance(allowed.get("torch.FloatStorage"), torch.serialization.StorageType)


def test_without_torchs_allowlist_the_fast_load_steps_aside(tmp_path, monkeypatch):
    from torch import _weights_only_unpickler as weights_only

    from ema_ckpt.formats.deepspeed import fastload
    from ema_ckpt.pickles.rules import torch_allows

    path, _ = _saved_data_pkl(tmp_path, {"w": torch.ones(2)})
    assert fastload.fast_load(path, {}) is not None
    monkeypatch.delattr(weights_only, "_get_allowed_globals")
    monkeypatch.setattr(fastload, "_ALLOWLISTS", [])
    assert torch_load.allowed_globals() is None
    assert fastload.fast_load(path, {}) is None  # torch's weights-only load reads it instead
    assert torch_allows("torch.Size") and not torch_allows("os.system")


def test_the_rebuild_functions_are_named_as_a_torch_save_pickle_names_them(tmp_path):
    for name, function in torch_load.rebuild_functions().items():
        assert f"{function.__module__}.{function.__qualname__}" == name
    _, data = _saved_data_pkl(tmp_path, {"w": torch.ones(2), "p": torch.nn.Parameter(torch.ones(2))})
    named = {tuple(str(arg).split(" ")) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    assert ("torch._utils", "_rebuild_tensor_v2") in named and ("torch._utils", "_rebuild_parameter") in named


def _steps(function: object) -> set[str]:
    """The names a function calls and the attributes it sets."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
             for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    sets = {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute)}
    return calls | sets


def test_the_rebuild_outside_fake_mode_is_torchs_rebuild_less_its_fake_mode_step():
    torchs = torch._utils._rebuild_tensor_v2
    assert inspect.signature(torch_load.rebuild_tensor_outside_fake_mode).parameters.keys() \
        == inspect.signature(torchs).parameters.keys()
    assert _steps(torchs) == {"_rebuild_tensor", "requires_grad", "set_tensor_metadata", "_backward_hooks",
                              "_restore_device_fake_mode"}, "torch's _rebuild_tensor_v2 changed its steps"
    base = torch.arange(12, dtype=torch.float32)
    storage = torch.storage.TypedStorage(wrap_storage=base.untyped_storage(), dtype=torch.float32, _internal=True)
    hooks: collections.OrderedDict = collections.OrderedDict()
    for metadata in (None, {}):
        args = (storage, 2, torch.Size((2, 3)), (4, 1), False, hooks, metadata)
        ours, theirs = torch_load.rebuild_tensor_outside_fake_mode(*args), torchs(*args)
        assert torch.equal(ours, theirs) and ours.stride() == theirs.stride() == (4, 1)
        assert ours.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert ours.storage_offset() == 2 and ours._backward_hooks is hooks and not ours.requires_grad
    with pytest.raises(TypeError):
        torch_load.rebuild_tensor_outside_fake_mode(base.untyped_storage(), 0, (1,), (1,), False, hooks)


def test_rebuild_from_type_builds_the_subclass_with_its_state():
    assert list(inspect.signature(torch._tensor._rebuild_from_type_v2).parameters) == [
        "func", "new_type", "args", "state"]
    built = torch_load.rebuild_from_type(torch.ones, torch.nn.Parameter, ((2,),), {"label": "x"})
    assert type(built) is torch.nn.Parameter and torch.equal(built, torch.ones(2)) and built.label == "x"


def test_element_size_and_typed_storage_are_torch_loads_own():
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64,
                  torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128):
        assert torch_load.element_size(dtype) == dtype.itemsize, dtype
    with pytest.raises(RuntimeError):
        torch_load.element_size("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        typed = torch_load.typed_storage(torch.UntypedStorage(8), torch.float32)
    assert type(typed) is torch.storage.TypedStorage and typed.dtype == torch.float32


def test_fake_mode_is_seen():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not torch_load.in_fake_mode()
    with FakeTensorMode():
        assert torch_load.in_fake_mode()


def test_the_zip_reader_reads_a_torch_save_file_as_zipfile_does(tmp_path):
    path, data = _saved_data_pkl(tmp_path, {"w": torch.arange(4, dtype=torch.int32)})
    reader = torch_load.zip_reader(path)
    records = set(reader.get_all_records())
    assert {"data.pkl", "byteorder", "data/0"} <= records
    assert bytes(reader.get_record("data.pkl")) == data
    offset = reader.get_record_offset("data/0")
    assert path.read_bytes()[offset:offset + 16] == torch.arange(4, dtype=torch.int32).numpy().tobytes()


def test_the_weights_only_unpickler_loads_data_and_refuses_code(tmp_path):
    _, data = _saved_data_pkl(tmp_path, {"a": 1, "b": [1.5, "x"], "c": torch.Size((2, 3))})
    assert torch_load.weights_only_unpickler(data).load() == {"a": 1, "b": [1.5, "x"], "c": torch.Size((2, 3))}
    with pytest.raises(pickle.UnpicklingError):
        torch_load.weights_only_unpickler(pickle.dumps(print, protocol=2)).load()


# --- DCP's _StorageInfo: ema_ckpt._compat.dcp_storage --------------------------------------------


def test_dcp_storage_info_is_torchs_with_the_fields_the_fallback_passes():
    from ema_ckpt._compat.dcp_storage import storage_info_class

    cls = storage_info_class()
    assert cls is filesystem._StorageInfo and dataclasses.is_dataclass(cls)
    assert [f.name for f in dataclasses.fields(cls)][:3] == ["relative_path", "offset", "length"]
    assert cls("__0_0.distcp", 1, 2) == filesystem._StorageInfo(relative_path="__0_0.distcp", offset=1, length=2)


# --- CPython's pickle internals: ema_ckpt._compat.pickle_internals ----------------------------------


def test_the_pure_python_unpickler_is_there_with_the_state_the_lean_unpickler_takes_over():
    from ema_ckpt._compat import pickle_internals as internals

    assert internals.PURE_PYTHON_AVAILABLE, "pickle._Unpickler or pickle._Stop is gone: large .metadata loads in C"
    assert internals.PurePythonUnpickler is pickle._Unpickler and internals.Stop is pickle._Stop
    opcodes = {op.code.encode("latin-1")[0] for op in pickletools.opcodes}
    assert opcodes <= set(internals.PurePythonUnpickler.dispatch), "an opcode has no handler"
    # LeanUnpickler.load sets up what pickle._Unpickler.load does, then runs the same handlers
    assert _steps(pickle._Unpickler.load) >= {"read", "readinto", "readline", "metastack", "stack", "append",
                                             "proto"}
    unpickler = internals.PurePythonUnpickler(io.BytesIO(b""))
    unpickler.stack, unpickler.metastack = ["loaded"], []
    with pytest.raises(internals.Stop) as stop:
        unpickler.dispatch[pickle.STOP[0]](unpickler)
    assert stop.value.value == "loaded"


def test_python3_name_reads_protocol_2_names_as_the_unpickler_does():
    import importlib

    from ema_ckpt._compat.pickle_internals import python3_name

    assert python3_name("__builtin__", "set") == ("builtins", "set")
    assert python3_name("copy_reg", "_reconstructor") == ("copyreg", "_reconstructor")
    assert python3_name("collections", "OrderedDict") == ("collections", "OrderedDict")
    checked = 0
    for module, name in [*_compat_pickle.NAME_MAPPING, ("copy_reg", "_reconstructor"), ("__builtin__", "len"),
                         ("Queue", "Queue"), ("collections", "OrderedDict")]:
        try:  # what CPython's own unpickler resolves a protocol 0-2 GLOBAL to (fix_imports)
            expected = pickle.loads(f"c{module}\n{name}\n.".encode())
        except Exception:
            continue  # a name this Python no longer has: nothing to compare
        mapped_module, mapped_name = python3_name(module, name)
        assert getattr(importlib.import_module(mapped_module), mapped_name) is expected, (module, name)
        checked += 1
    assert checked > 50


# --- The collector: gc.freeze semantics and the helpers in ema_ckpt._gc --------------------------


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    """A reference cycle nothing else holds: only a cyclic collection frees it."""
    return weakref.ref(_Cyclic())


def _tracked(obj: object) -> bool:
    """Whether ``obj`` is in a collected generation (frozen objects are in none of them)."""
    return any(o is obj for o in gc.get_objects())


def _any_tracked(objs: list) -> bool:
    """Whether any of ``objs`` is in a collected generation. Sentinels, not the freeze count:
    another thread of the test process may free frozen objects at any moment."""
    collected = {id(o) for o in gc.get_objects()}
    return any(id(o) in collected for o in objs)


@pytest.fixture
def collector():
    assert gc.get_freeze_count() == 0, "something else left objects frozen"
    enabled = gc.isenabled()
    gc.disable()  # no collection at a moment the tests do not choose
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


def test_gc_freeze_leaves_frozen_objects_out_of_collections_until_unfrozen(collector):
    before = _cycle()
    gc.freeze()
    assert gc.get_freeze_count() > 0
    after = _cycle()
    gc.collect()
    assert before() is not None and after() is None
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None


def test_frozen_heap_nests_and_restores_the_freeze_count(collector):
    outside = _cycle()
    with _gc.frozen_heap():
        inside = _cycle()
        made_inside = [[] for _ in range(1000)]  # lists: tracked by the collector
        with _gc.frozen_heap():  # a nested block sets aside what was made since
            assert not _any_tracked(made_inside)
        nested = _cycle()
        gc.collect()
        assert outside() is not None and inside() is not None and nested() is None
        assert not _any_tracked(made_inside)  # frozen until the outermost block ends
    assert gc.get_freeze_count() == 0 and made_inside
    gc.collect()
    assert outside() is None and inside() is None


def test_frozen_heap_restores_the_count_when_the_block_fails(collector):
    with pytest.raises(KeyError), _gc.frozen_heap():
        raise KeyError("x")
    assert gc.get_freeze_count() == 0




def test_frozen_heap_leaves_a_callers_own_freeze_alone(collector):
    # Sentinels, not the freeze count alone: another thread of the test process may free frozen
    # objects meanwhile (the count once fell by 13 in a full run), but nothing moves these two.
    theirs = []
    gc.freeze()  # a caller's own freeze (before a fork, say)
    frozen = gc.get_freeze_count()
    ours = []  # made after it: frozen again only if frozen_heap froze
    with _gc.frozen_heap():
        [[] for _ in range(1000)]
        assert gc.get_freeze_count() <= frozen and _tracked(ours)  # nothing frozen again
    assert not _tracked(theirs) and _tracked(ours)  # the caller's objects still frozen, not unfrozen


def test_frozen_heap_does_nothing_without_gc_freeze(collector, monkeypatch):
    monkeypatch.setattr(_gc, "_CAN_FREEZE", False)
    with _gc.frozen_heap():
        assert gc.get_freeze_count() == 0


def test_paused_gc_restores_the_collectors_state():
    enabled = gc.isenabled()
    try:
        gc.enable()
        with pytest.raises(KeyError), _gc.paused_gc():
            assert not gc.isenabled()
            raise KeyError("x")
        assert gc.isenabled()
        gc.disable()
        with _gc.paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()


def test_import_module_sets_modules_aside_only_in_a_process_that_owns_its_heap():
    # a fresh interpreter: which modules are imported, and what is frozen, is this test's alone
    code = """
import gc, sys
from ema_ckpt import _gc
from ema_ckpt._compat import torch_load
assert gc.get_freeze_count() == 0
_gc.import_module("json")  # a library caller's process: a plain import
assert "json" in sys.modules and gc.get_freeze_count() == 0
_gc.own_the_heap()
_gc.import_module("decimal")
settled = gc.get_freeze_count()
assert settled > 0 and gc.isenabled()
with _gc.frozen_heap():  # the job runner's block still owns the collector, then unfreezes all
    assert gc.get_freeze_count() >= settled
assert gc.get_freeze_count() == 0
gc.freeze()  # another freeze of the process's own (before a fork, say)
theirs = gc.get_freeze_count()
_gc.import_module("fractions")
assert "fractions" in sys.modules and gc.get_freeze_count() <= theirs
with _gc.frozen_heap():
    assert gc.get_freeze_count() <= theirs
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


def test_the_command_line_and_python_m_own_their_heap():
    for entry in ("from ema_ckpt import _entry; _entry.main()",
                  "import runpy; runpy.run_module('ema_ckpt', run_name='__main__')"):
        code = f"""
import sys
from ema_ckpt import _gc
from ema_ckpt._compat import torch_load
sys.argv = ["ema-ckpt", "--help"]
try:
    {entry}
except SystemExit:
    pass
assert _gc._owns_heap
"""
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr


# --- gcsfs: the request loop that EMA_CKPT_REMOTE_ATTEMPTS bounds ----------------------------------


def test_gcsfs_request_loop_is_bounded_by_the_attempts_asked_for():
    """``storage/object_clients._bounded_gcs_class`` rebuilds gcsfs's ``_request`` from its
    undecorated function with ``gcsfs.retry.retry_request``; a server that answers 503 to
    everything then sees exactly the attempts asked for (gcsfs's own loop makes 6)."""
    import http.server
    import threading

    import fsspec

    pytest.importorskip("gcsfs")
    from gcsfs.core import GCSFileSystem  # the plain JSON-API class (gcsfs.GCSFileSystem asks gRPC first)

    from ema_ckpt.storage.object_clients import _bounded_gcs_class

    for base in (GCSFileSystem, fsspec.get_filesystem_class("gs")):
        bounded = _bounded_gcs_class(base, 2)
        assert bounded is not base and issubclass(bounded, base), (
            f"{base.__name__}._request is no longer gcsfs.retry.retry_request around a plain function: "
            "EMA_CKPT_REMOTE_ATTEMPTS no longer bounds GCS requests (see _bounded_gcs_class)")
    requests = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            body = b'{"error": {"code": 503, "message": "unavailable"}}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fs = _bounded_gcs_class(GCSFileSystem, 2)(
            endpoint_url=f"http://127.0.0.1:{server.server_address[1]}", token="anon", skip_instance_cache=True)
        with pytest.raises(Exception, match="unavailable"):
            fs.cat_file("bucket/object")
    finally:
        server.shutdown()
    assert len(requests) == 2, requests
