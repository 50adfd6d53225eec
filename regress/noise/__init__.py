"""The baseline's own noise: arms that replay it with nothing that should matter changed
(:mod:`regress.noise.arms`), the envelope and floor they measure, stored as ``golden/noise.json``,
and how scoring applies it (:mod:`regress.noise.floor`). Settings: :mod:`regress.noise.settings`.

Kept import-light: :mod:`regress.records` and :mod:`regress.config` import submodules of it.
"""
