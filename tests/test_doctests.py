"""Every docstring example of the package runs and shows what the code returns (those marked
``+SKIP`` need a real checkpoint folder, an object store or many processes)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ema_ckpt"
MODULES = sorted(
    ".".join(("ema_ckpt", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
    if "__pycache__" not in path.parts and path.name != "__main__.py"
)


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_module_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # an example that writes a relative path writes it here
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {name} failed (above)"
