"""The packages' layering: `loadout` (the library) never imports `train` (the template), and each package imports on
its own in a fresh interpreter (no import circle hides behind the order the entry points happen to import in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ["loadout", "loadout.data", "loadout.observe", "loadout.runtime", "loadout.run", "loadout.tune",
            "train", "train.task", "train.loop", "train.tune"]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, those inside functions and `if TYPE_CHECKING:` included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def test_the_library_never_imports_the_template():
    crossings = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                 for path in sorted((ROOT / "loadout").rglob("*.py"))
                 for line, module in imported_modules(path) if module == "train" or module.startswith("train.")]
    assert not crossings, "loadout must not import train (hand the part in instead):\n" + "\n".join(crossings)
    reads_conf = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "loadout").rglob("*.py"))
                  if '/ "conf"' in path.read_text()]
    assert not reads_conf, f"the template's conf/ is handed in (Schema.conf, Hydra's config source): {reads_conf}"


def test_the_rule_sees_a_crossing(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from train.task import build_task\n")
    assert imported_modules(module) == [(2, "train.task")]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_imports_first_in_a_fresh_interpreter(package):
    result = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
