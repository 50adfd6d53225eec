"""The baseline's own noise: measuring it, storing it and applying it in scoring.

Arms replay the baseline with nothing that should matter changed (:mod:`regress.noise.arms`);
the envelope and floor they measure are stored as ``golden/noise.json``; scoring applies the
noise (:mod:`regress.noise.floor`). Settings: :mod:`regress.noise.settings`.

Kept import-light: :mod:`regress.records` and :mod:`regress.config` import submodules of it.
"""
