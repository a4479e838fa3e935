"""``torch.save`` records (one zip: a DCP chunk, a DeepSpeed ``.pt``, a state dict), read and
written in one place, zip64 included."""

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
