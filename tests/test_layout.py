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
