"""A test engine plugin package, ``regress-test-engine``, built as real wheels in 8 versions.

Each version is a vLLM general plugin (entry point group ``vllm.general_plugins``: vLLM calls
``register()`` in every process that loads a model). From :data:`FIRST_BAD` on, it perturbs the
model as it loads: Gaussian noise on every weight of decoder layer 1, half of each tensor's
standard deviation (the damage ``regress.model_variants.perturb_layer`` writes to disk, done here
in the engine), with a fixed seed. Earlier versions change nothing. So a bisect between the first
and the last version must name FIRST_BAD.
"""

from __future__ import annotations

from pathlib import Path

from wheels import build_wheel

PACKAGE = "regress-test-engine"
MODULE = "regress_test_engine"
VERSIONS = ["1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7"]
FIRST_BAD = "1.5"

SOURCE = '''"""regress-test-engine {version}: a vLLM general plugin for regress's bisect tests."""

__version__ = "{version}"
PERTURBS = {perturbs}


def register():
    if not PERTURBS:
        return
    import torch
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights
    if getattr(original, "_regress_test_engine", False):  # vLLM may call register() again
        return

    def load_weights(self, model, model_config):
        original(self, model, model_config)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                if ".layers.1." in name and param.dtype.is_floating_point:
                    wide = param.data.float()
                    noise = torch.randn(wide.shape, generator=generator) * 0.5 * float(wide.std())
                    param.data.copy_((wide + noise).to(param.dtype))

    load_weights._regress_test_engine = True
    DefaultModelLoader.load_weights = load_weights
'''


def perturbs(version: str) -> bool:
    from packaging.version import Version

    return Version(version) >= Version(FIRST_BAD)


def build_plugin_wheels(dest: Path) -> list[Path]:
    """One wheel per version in ``dest``."""
    return [
        build_wheel(dest, PACKAGE, version,
                    {f"{MODULE}/__init__.py": SOURCE.format(version=version, perturbs=perturbs(version))},
                    entry_points={"vllm.general_plugins": {MODULE: f"{MODULE}:register"}})
        for version in VERSIONS
    ]
