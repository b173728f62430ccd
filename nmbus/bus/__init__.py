"""The Bus: an endpoint's registration, its sending, and the services it runs.

:class:`~nmbus.bus.bus.Bus` is a composition root: it builds the store, the
worker (:mod:`nmbus.consume`), the saga and delivery features, and the
maintenance services, and wires them together. Its registration
(:mod:`nmbus.bus.registration`) and sending (:mod:`nmbus.bus.sending`) are
what an application calls.
"""

from nmbus.bus.bus import Bus

__all__ = ["Bus"]
