"""What a run records and watches: the quarantine registry (:mod:`.quarantine`), the
stall watchdog (:mod:`.watchdog`), the run summary (:mod:`.summary`, and
:mod:`.trainer_callback` for a transformers ``Trainer``), the error budget
(:mod:`.budget`) and what is counted around each decode (:mod:`.accounting`).

May import the foundations (``config``, ``errors``, ``process``, ``logs``),
:mod:`..engine`'s run folders, :mod:`..confinement`'s output capture and
:mod:`..patching`; never :mod:`..hosts`, :mod:`..checks` or the activation layer.
"""
