"""Host adapters: one folder per host framework (:mod:`.swift` for ms-swift,
:mod:`.lerobot`, :mod:`.llamafactory`), each filling in the adapter protocol of
:mod:`..patching.host_adapters` with a table of patch targets, plus the
``--safe_media*`` flags they share (:mod:`.flags`).

The top of the import graph below the activation layer: adapters may import the core
(engine, confinement, workers, records, patching, decoders, the foundations) and
``activation``; nothing in the core imports an adapter.
"""
