"""Reliances on private torch and CPython behaviour, one module each.

Each module says what private name or behaviour it relies on, why that pays, and what
happens when it is gone; ``tests/test_compat.py`` checks each against the installed torch
and Python and fails loudly when one changes. A reliance that belongs to one format lives in
that format's package with the same docstring and the same test:

- :mod:`ema_ckpt.formats.dcp.metadata_pickle`: DCP's ``.metadata`` pickle written opcode by
  opcode (torch's private ``_StorageInfo``, ``_MEM_FORMAT_ENCODING``, ``_get_layout`` and
  its dataclasses' layout); falls back to torch's own classes.
- :mod:`ema_ckpt._compat.fast_exit`: ``atexit._run_exitfuncs`` + ``os._exit``, ending the
  CLI without interpreter teardown; falls back to ``sys.exit``.

The collector's freeze semantics, public CPython API, are relied on in :mod:`ema_ckpt._gc`
and checked by the same test file.
"""
