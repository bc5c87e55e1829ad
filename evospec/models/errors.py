"""Errors raised while locating, verifying or reading model files."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A model file is missing, corrupt, truncated or fails its checksum.

    The message always names the file (when known) and what is wrong with it.
    """

    def __init__(self, path: str | Path | None, problem: str) -> None:
        self.path = None if path is None else Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)
