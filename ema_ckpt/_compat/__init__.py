"""Reliances on private torch and CPython behaviour, one module each.

Each module says what private name it relies on, why that pays, and what happens when it is
gone; ``tests/test_compat.py`` checks each against the installed torch and Python. No module
outside this package names a private name of torch (``tests/test_structure.py``). A pickle
layout a format writes lives with that format under the same docstring and test
(:mod:`ema_ckpt.formats.dcp.metadata_pickle`, DCP's ``.metadata``). The collector's freeze
semantics, public CPython API, are relied on in :mod:`ema_ckpt._gc` and checked there too.
"""
