"""What every command that writes a project runs under: the project lock, then the phase deadlines.

``golden``, ``noise``, ``replay``, ``score``, ``check``, ``diagnose``, ``report`` and ``bisect``
run their work inside :func:`writing_project`: a second command on the same project exits 2
naming the first (:mod:`regress.project_lock`), and a phase that runs past its deadline exits 3
naming the phase (:mod:`regress.deadlines`, :mod:`regress.watchdog`).
"""

from __future__ import annotations

import shlex
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from regress.config import Params


def command_line() -> str:
    """This process's ``regress`` command line, credentials redacted (it is shown to others)."""
    from regress.redact import redact

    return redact(" ".join(["regress", *map(shlex.quote, sys.argv[1:])]))


@contextmanager
def writing_project(params: "Params") -> Iterator[None]:
    """Hold ``params``' project lock and watch the phase deadlines (params' ``deadlines:``, with
    ``REGRESS_DEADLINE_*`` applied: a bad value is exit 2 before anything runs)."""
    from regress.deadlines import watching
    from regress.home import regress_home
    from regress.project_lock import project_lock

    settings = params.deadlines.with_environment()
    with project_lock(params.root, command_line()), watching(settings, log_dir=regress_home() / "logs"):
        yield
