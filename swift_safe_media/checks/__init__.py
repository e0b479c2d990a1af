"""Checks a user runs before or around training: the pre-flight check that the decoders
load (:mod:`.preflight`, also run once by ``enable()``), ``swift-safe-media doctor``
(:mod:`.doctor`) and the dataset scan, local or on Ray (:mod:`.scan`, :mod:`.scan_ray`).

A layer above the core: it may import anything but :mod:`..hosts`' adapters (it asks
:mod:`..patching.host_adapters` about hosts); nothing in the core imports it.
"""
