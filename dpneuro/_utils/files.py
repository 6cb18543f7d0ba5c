"""Files a party writes for itself: folders no other user of the machine may read, and JSON written atomically."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

__all__ = ["private_dir", "write_json"]


def private_dir(path) -> Path:
    """A folder only its owner can enter (0700), created if needed: for a site's un-noised intermediate data,
    which no other user of the machine may read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_json(path, obj) -> Path:
    """Write JSON atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default))
    tmp.replace(path)
    return path


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
