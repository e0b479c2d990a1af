"""How protection hooks into code it does not own, host or none.

Owns: patch targets as data and the alias-aware patcher (:mod:`.targets`), post-import
hooks (:mod:`.import_hooks`), torch's DataLoader as a target table
(:mod:`.torch_dataloader`), the host adapter protocol and the hosts' registry
(:mod:`.host_adapters`), and the media libraries' own entry points, bounded with any
host or none (:mod:`.media_libraries`). Part of the core: it may import the
foundations and :mod:`..decoders`, never :mod:`..hosts` (adapters register
themselves here; this package only looks them up).
"""
