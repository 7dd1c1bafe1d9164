"""Where the repository and its shared data are, for tests at any depth."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
