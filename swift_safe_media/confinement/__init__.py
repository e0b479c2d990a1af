"""Sandbox confinement: what a sandbox may do once it is forked.

Owns: the policy and applying it (:mod:`.policy`), the seccomp filter (:mod:`.syscalls`),
seccomp and Landlock through ctypes
(:mod:`.kernel`), what a sandbox may read (:mod:`.reads`), media handed to a decode as
open descriptors (:mod:`.handed`), the environment allow-list (:mod:`.environment`) and
a sandbox's captured output (:mod:`.output`). May import only the package's foundations
(``config``, ``errors``, ``process``); the engine imports it, never the reverse.
"""
