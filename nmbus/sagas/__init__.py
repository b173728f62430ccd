"""Sagas: the saga type and its handlers (:mod:`~nmbus.sagas.saga`), the locks
a batch takes on its sagas (:mod:`~nmbus.sagas.locks`), and the states it
reads and writes in its transaction (:mod:`~nmbus.sagas.states`)."""
