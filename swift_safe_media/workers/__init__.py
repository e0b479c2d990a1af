"""How a DataLoader's workers start while protection is on.

Owns: the one patch of torch's DataLoader and the checks as workers start
(:mod:`.start`), the warm forkserver (:mod:`.forkserver`, with its imports in
:mod:`._forkserver_preload`), the workers of a script with no host (:mod:`.plain`),
unguarded main scripts (:mod:`.spawn_guard`) and the watch forkserver-born workers keep
on their trainer (:mod:`.trainer_watchdog`). May import the foundations, :mod:`..engine`,
:mod:`..confinement`, :mod:`..records` and :mod:`..patching` (which asks the registered
host adapters); never :mod:`..hosts` itself.
"""
