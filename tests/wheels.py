"""Wheels written by hand for tests (no build backend, no network): a wheel is a zip of the
package's files and ``<name>-<version>.dist-info/{METADATA,WHEEL,RECORD}``."""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(dest_dir: Path, name: str, version: str, files: dict[str, str],
                entry_points: dict[str, dict[str, str]] | None = None, requires: list[str] = ()) -> Path:
    """Write a pure-Python ``py3-none-any`` wheel of ``name`` ``version`` into ``dest_dir``.

    ``files``: path inside the wheel (``tiny_pkg/__init__.py``) to text. ``entry_points``: group
    (``console_scripts``, ``vllm.general_plugins``) to {entry name: ``module:attr``}.
    ``requires``: ``Requires-Dist`` lines (pip requirements). Returns the wheel's path.
    """
    dist = re.sub(r"[-_.]+", "_", name)  # the wheel file and .dist-info name form (PEP 427)
    info = f"{dist}-{version}.dist-info"
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                *(f"Requires-Dist: {r}" for r in requires)]
    contents = {path: text.encode() for path, text in files.items()}
    contents[f"{info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    contents[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests.wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if entry_points:
        sections = [f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items())
                    for group, entries in entry_points.items()]
        contents[f"{info}/entry_points.txt"] = "\n".join(sections).encode()
    record = [f"{path},{_record_hash(data)},{len(data)}" for path, data in contents.items()]
    contents[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    dest_dir.mkdir(parents=True, exist_ok=True)
    wheel = dest_dir / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in contents.items():
            zf.writestr(path, data)
    return wheel
