"""The in-memory adapter of the storage and operations ports, for unit tests.

Its public face is :mod:`nmbus.testing` (``MemoryStore``, ``Row``, ``drain``).
"""
