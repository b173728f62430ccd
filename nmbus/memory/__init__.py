"""The in-memory adapter of the storage port: the store application tests run on.

Its public face is :mod:`nmbus.testing` (``MemoryStore``, ``Row``, ``drain``).
"""
