"""Small helpers every layer shares: where things live, and argument types.

Owns: the default shared-data folder (next to a checkout; a user's install has none), the
``$EVOSPEC_HOME`` cache root, and ``positive_int`` for command-line flags. Imports nothing
of the project, so any module may import it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def evospec_home() -> Path:
    """The cache root: ``$EVOSPEC_HOME``, else ``~/.cache/evospec``."""
    return Path(os.environ.get("EVOSPEC_HOME", Path.home() / ".cache" / "evospec")).expanduser()


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v
