"""The engine process and the orchestrator's handle on it.

- :mod:`regress.engine.protocol`: every message between the two, one JSON object per line;
- :mod:`regress.engine.server`: the engine process (``python -m regress.engine.server``), run
  with a candidate environment's interpreter;
- :mod:`regress.engine.client`: :class:`~regress.engine.client.EngineProcess`, the
  orchestrator's side.

The server and the modules it imports (protocol, facts, vocabulary) run inside candidate
environments, which hold the engine but not regress's dependencies: they import only the
standard library and numpy. So does this package's ``__init__``: it imports nothing.
"""
