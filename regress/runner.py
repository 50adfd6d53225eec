"""The engine process's former entry point, ``python -m regress.runner``, kept for old callers.

It is kept so that scripts and notes that start it that way still work. The engine process is
:mod:`regress.engine.server`."""

from regress.engine.server import main

if __name__ == "__main__":
    main()
