"""Diagnosis: why a candidate's prompts drifted (``regress diagnose``).

The drifted prompts are run again under probes, each changing one thing (the batch, a setting
reverted to the baseline's, float32 on both sides, ...); the probe whose change removes a
prompt's drift names its source. See :mod:`regress.diagnosis.probes` (what can be changed),
:mod:`regress.diagnosis.run` (running them, one engine per configuration) and
:mod:`regress.diagnosis.attribute` (from observations to causes).
"""
