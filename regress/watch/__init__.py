"""The release watcher (``regress watch``): one regression check per new engine release.

New engine releases on the package index become regression checks, one per version.

::

    index.py     the releases of a package (PEP 691 JSON simple API, the index pip uses)
    state.py     what has been seen, claimed and checked (a JSON file, or Redis)
    triggers.py  how a check starts: local, celery (a task) or github (the workflow)
    notify.py    the webhook on a regression
    watcher.py   one tick: fetch, filter, diff against the state, claim, trigger, record
    tasks.py     the Celery tick and check tasks and the beat schedule
    settings.py  the schema of the ``watch:`` section of params.yaml
    config.py    that section with the environment's secrets and command-line options on top
    cli.py       the ``regress watch`` command

Nothing here imports Celery unless the celery trigger, a task or beat is used.
"""
