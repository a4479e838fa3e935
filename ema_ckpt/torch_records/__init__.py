"""``torch.save`` records, read and written in one place (zip64 included).

A record is one ``torch.save`` zip: a DCP chunk inside a ``.distcp`` file, a DeepSpeed
``.pt``, a ``.pt`` state dict. :mod:`.zipfmt` owns the zip struct layouts and locating a
member's bytes; :mod:`.pickles` reads a record's ``data.pkl`` through a restricted unpickler
into :class:`TensorRecord` s (where each tensor's bytes lie, nothing built); :mod:`.tree` reads a
whole file's pickle as inert data and judges the globals it names; :mod:`.legacy` finds the
pickle and storages of torch's pre-1.6 format; :mod:`.emit` writes inert data back;
:mod:`.write` writes pickles and records byte for byte as torch does.
"""

from .pickles import TensorRecord, load_tensor_record, tensor_view_problem, view_problem
from .write import StateDictFileWriter, state_dict_pickle, tensor_pickle, writable_dtype, write_tensor_record
from .zipfmt import FileWindow, member_start, scan_record

__all__ = [
    "FileWindow",
    "StateDictFileWriter",
    "TensorRecord",
    "load_tensor_record",
    "member_start",
    "scan_record",
    "state_dict_pickle",
    "tensor_pickle",
    "tensor_view_problem",
    "view_problem",
    "writable_dtype",
    "write_tensor_record",
]
