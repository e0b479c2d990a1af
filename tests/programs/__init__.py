"""Child programs of the fresh-interpreter tests, run as ``python -m tests.programs.NAME``
(see ``tests/fresh.py``): importable, so linters and readers see them as code. Each says
in its docstring what it does and its argv. The upstream repros (``*_decode_repro``) run by
path instead, with only the host's tree on ``PYTHONPATH``."""
