"""The wings' import contracts (pyproject.toml, [tool.importlinter]) hold:
no wing imports one above it, engines and sessions stay independent, and
production never imports the emulator. A violation prints the import chain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import ROOT


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
