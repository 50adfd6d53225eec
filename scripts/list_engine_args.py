#!/usr/bin/env python3
"""Write the engine argument names of the vLLM releases regress checks against
(regress/data/vllm_engine_args.json), so params.yaml can catch a misspelt ``engine_args`` key
(``kv_cache_dtpye``) before an environment is built and an engine started; and the JSON types of
the arguments whose annotation is plain (regress/data/vllm_engine_arg_types.json: ``bool``,
``int``, ``float``, ``str``, ``null``), so ``max_model_len: true`` is refused as early.

    python scripts/list_engine_args.py PYTHON [PYTHON ...]   # each a python that imports vllm

Each interpreter prints its ``vllm.__version__`` and the fields of ``vllm.engine.arg_utils.EngineArgs``;
the file keeps one sorted list per version (existing versions are kept unless listed again). The
types file keeps, per argument, the union of the types the listed releases allow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "regress" / "data"
OUT = DATA / "vllm_engine_args.json"
TYPES_OUT = DATA / "vllm_engine_arg_types.json"
PROBE = """
import dataclasses, json, typing, vllm
from vllm.engine.arg_utils import EngineArgs
plain = {"bool": "bool", "int": "int", "float": "float", "str": "str", "None": "null", "NoneType": "null"}
types = {}
for f in dataclasses.fields(EngineArgs):
    t = f.type
    if typing.get_origin(t) is typing.Literal:
        args = typing.get_args(t)
        if all(isinstance(a, str) for a in args):
            types[f.name] = ["str"]
        continue
    text = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    optional = text.startswith("Optional[")
    text = text.removeprefix("Optional[").removesuffix("]") if optional else text
    parts = [p.strip() for p in text.split("|")] + (["None"] if optional else [])
    if all(p in plain for p in parts):
        types[f.name] = sorted({plain[p] for p in parts})
print(json.dumps([vllm.__version__, sorted(f.name for f in dataclasses.fields(EngineArgs)), types]))
"""


def main(pythons: list[str]) -> None:
    known = json.loads(OUT.read_text(encoding="utf-8")) if OUT.exists() else {}
    all_types: dict[str, set[str]] = {}
    if TYPES_OUT.exists():
        all_types = {k: set(v) for k, v in json.loads(TYPES_OUT.read_text(encoding="utf-8")).items()}
    for python in pythons:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True).stdout
        version, names, types = json.loads(out.strip().splitlines()[-1])
        known[version] = names
        for name, allowed in types.items():
            all_types.setdefault(name, set()).update(allowed)
        print(f"vllm {version}: {len(names)} engine arguments, {len(types)} of plain type")
    OUT.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n", encoding="utf-8")
    TYPES_OUT.write_text(json.dumps({k: sorted(v) for k, v in sorted(all_types.items())}, indent=1) + "\n",
                         encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:] or [sys.executable])
