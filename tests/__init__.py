"""The test suites: tests/unit mirrors the package's wings, tests/integration
starts real servers (grouped by area), tests/emulator checks the SGLang
emulator itself; tests/frameworks and tests/deploy run on their own."""

from pathlib import Path

# The repository root and the committed test data, wherever a test module sits.
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
