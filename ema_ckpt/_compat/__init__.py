"""Reliances on private torch and CPython behaviour, one module each.

Each module says what private name or behaviour it relies on, why that pays, and what
happens when it is gone; ``tests/test_compat.py`` checks each against the installed torch
and Python and fails loudly when one changes. No module outside this package names a private
name of torch (``tests/test_structure.py`` checks it). A pickle layout that one format writes
lives in that format's package with the same docstring and the same test:

- :mod:`ema_ckpt.formats.dcp.metadata_pickle`: DCP's ``.metadata`` pickle written opcode by
  opcode (the layout of torch's private ``_StorageInfo``, ``_MEM_FORMAT_ENCODING``,
  ``_get_layout`` and its dataclasses, as bytes); falls back to torch's own classes
  (``_StorageInfo`` from :mod:`ema_ckpt._compat.dcp_storage`).
- :mod:`ema_ckpt._compat.fast_exit`: ``atexit._run_exitfuncs`` + ``os._exit``, ending the
  CLI without interpreter teardown; falls back to ``sys.exit``.
- :mod:`ema_ckpt._compat.torch_load`: the private pieces of ``torch.load`` (the weights-only
  unpickler and its allowlist, the tensor rebuilds, the zip reader, the fake-mode check) that
  DeepSpeed's ``.pt`` files are read with and ``torch.save`` records are written to name;
  without the allowlist the fast load steps aside.
- :mod:`ema_ckpt._compat.dcp_storage`: DCP's private ``_StorageInfo``, for the ``.metadata``
  emitter's fallback.
- :mod:`ema_ckpt._compat.pickle_internals`: CPython's pure-Python unpickler (``pickle._Unpickler``,
  ``pickle._Stop``), which a large ``.metadata`` loads through with a lean memo, and the
  Python 2 names of ``_compat_pickle``; without the former, every pickle loads in C.

The collector's freeze semantics, public CPython API, are relied on in :mod:`ema_ckpt._gc`
and checked by the same test file.
"""
