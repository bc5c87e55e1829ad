"""Where shared inputs live by default (the shared data folder next to the checkout)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
