"""The layout of the package: the import contracts and the size of its modules.

- Every import contract in ``pyproject.toml`` (``[tool.importlinter]``) is kept, checked by
  running ``lint-imports`` as ``make check`` does.
- No module under ``src/dmsc`` is longer than :data:`MAX_LINES` lines, unless its module
  docstring says why in a sentence with the words "long because" (for example: "Long because the
  four message kinds share one framing and splitting them would hide it."). A module past that
  size usually holds two ideas; the exception has to be argued where the next reader sees it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "dmsc"
MAX_LINES = 500
EXCUSE = "long because"


def test_every_import_contract_is_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    res = subprocess.run(
        [str(lint_imports), "--no-cache"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    summary = [line for line in res.stdout.splitlines() if line.startswith("Contracts:")]
    assert summary and summary[-1].endswith(" 0 broken."), res.stdout
    assert "BROKEN" not in res.stdout


def test_no_module_is_long_without_a_reason() -> None:
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines <= MAX_LINES:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if EXCUSE not in " ".join(docstring.lower().split()):
            unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not unexplained, (
        f"over {MAX_LINES} lines without '{EXCUSE} ...' in the module docstring: {unexplained}"
    )


def test_every_control_package_docstring_names_each_of_its_modules() -> None:
    """``runtime/control/`` and each of its sub-packages say in their docstring what every module
    (and sub-package) in them is: one that is added without a word there fails here."""
    root = Path(__file__).resolve().parents[1] / "src" / "dmsc" / "runtime" / "control"
    unnamed = {}
    for init in [root / "__init__.py", *sorted(root.glob("*/__init__.py"))]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        here = init.parent
        names = [p.stem for p in here.glob("*.py") if p.stem != "__init__"]
        names += [p.name for p in here.iterdir() if (p / "__init__.py").exists()]
        missing = sorted(n for n in names if f":mod:`.{n}`" not in doc)
        if missing:
            unnamed[str(here.relative_to(root.parent))] = missing
    assert not unnamed, unnamed
