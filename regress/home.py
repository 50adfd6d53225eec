"""Where regress keeps its caches: ``$REGRESS_HOME``, else ``~/.cache/regress``."""

from __future__ import annotations

import os
from pathlib import Path


def regress_home() -> Path:
    """Root of regress's caches: ``$REGRESS_HOME`` or ``~/.cache/regress``."""
    return Path(os.environ.get("REGRESS_HOME") or Path.home() / ".cache" / "regress")
