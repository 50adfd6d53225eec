"""``python -m regress``: the same command as the ``regress`` console script (pyproject.toml)."""

from regress.cli import main

if __name__ == "__main__":
    main()
