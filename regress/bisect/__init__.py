"""``regress bisect PACKAGE --good V1 --bad V2``: which release between the two changed the outputs.

V1 is a good release and V2 a bad one.

- :mod:`regress.bisect.plan`: the releases between the two (from the package index pip uses,
  through the watcher's PEP 691 client) and the candidate each becomes;
- :mod:`regress.bisect.record`: the bisect's state file, written after every check, so an
  interrupted bisect resumes from its finished checks;
- :mod:`regress.bisect.run`: the binary search itself, each step a normal check
  (:func:`regress.checks.run_check`) against the golden, local or through Celery;
- :mod:`regress.bisect.cli`: the command.
"""
