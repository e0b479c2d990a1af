"""Imported only by a thread of a DataLoader worker in tests/programs/forked_forkserver.py:
a module nothing else imports, so the import needs the import lock."""
