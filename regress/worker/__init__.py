"""Replay on Celery workers over Redis.

Its modules: the app (``app``), the shard task (``tasks``), the orchestrator's side
(``executor``) and the ``regress worker`` process (``process``).

Nothing here is imported unless the Celery executor or a worker is used.
"""
