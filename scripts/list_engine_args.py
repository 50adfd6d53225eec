#!/usr/bin/env python3
"""Write the engine argument names of the vLLM releases regress checks against
(regress/data/vllm_engine_args.json), so params.yaml can catch a misspelt ``engine_args`` key
(``kv_cache_dtpye``) before an environment is built and an engine started.

    python scripts/list_engine_args.py PYTHON [PYTHON ...]   # each a python that imports vllm

Each interpreter prints its ``vllm.__version__`` and the fields of ``vllm.engine.arg_utils.EngineArgs``;
the file keeps one sorted list per version (existing versions are kept unless listed again).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "regress" / "data" / "vllm_engine_args.json"
PROBE = ("import dataclasses, json, vllm; from vllm.engine.arg_utils import EngineArgs; "
         "print(json.dumps([vllm.__version__, sorted(f.name for f in dataclasses.fields(EngineArgs))]))")


def main(pythons: list[str]) -> None:
    known = json.loads(OUT.read_text(encoding="utf-8")) if OUT.exists() else {}
    for python in pythons:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True).stdout
        version, names = json.loads(out.strip().splitlines()[-1])
        known[version] = names
        print(f"vllm {version}: {len(names)} engine arguments")
    OUT.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:] or [sys.executable])
