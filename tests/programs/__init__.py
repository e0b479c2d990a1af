"""Child programs of the fresh-interpreter tests, run as ``python -m tests.programs.NAME``
(see ``tests/fresh.py``): importable, so linters and readers see them as code."""
