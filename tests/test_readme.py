"""The README's test command is the one CI runs (.ci/run's last line), verbatim."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ci_command() -> str:
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip()]
    return lines[-1]


def test_ci_runs_the_tests() -> None:
    command = _ci_command()
    assert "pytest" in command and '-m "not slow"' in command


def test_readme_shows_the_ci_command_verbatim() -> None:
    readme = ROOT / "README.md"
    assert readme.is_file(), "README.md is missing"
    assert _ci_command() in readme.read_text()
