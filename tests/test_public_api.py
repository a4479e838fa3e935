"""The public API: eleven documented functions in ``ema_ckpt``, cheap to import."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import ema_ckpt

FUNCTIONS = ["accumulate", "posthoc", "average", "consolidate", "reshard", "inspect", "inspect_folder", "verify",
             "diff", "open_checkpoint", "select", "watch"]


def test_importing_the_package_loads_neither_the_commands_nor_torch():
    code = ("import sys, ema_ckpt; "
            "assert 'torch' not in sys.modules, 'torch'; "
            "assert not [m for m in sys.modules if m.startswith('ema_ckpt.commands')], 'commands'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_is_a_documented_function_even_after_every_module_is_imported():
    for module in pkgutil.walk_packages(ema_ckpt.__path__, "ema_ckpt."):
        if not module.name.startswith(("ema_ckpt.cli", "ema_ckpt.__main__")):
            importlib.import_module(module.name)
    assert sorted(FUNCTIONS) == sorted(n for n in ema_ckpt.__all__ if n != "__version__")
    for name in FUNCTIONS:
        function = getattr(ema_ckpt, name)
        assert inspect.isfunction(function), name  # a submodule of the same name must not shadow it
        assert function.__doc__ and "Example" in function.__doc__, name
    assert "accumulate" in dir(ema_ckpt)
