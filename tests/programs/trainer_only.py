"""Imported by tests.programs.forked_forkserver's trainer between its host's first import and
``enable()``, and by nothing else: a worker that has it got it from a forkserver forked after."""
