"""The options of bench's modes: nmbus bench's, and those only the modes here use."""

from __future__ import annotations

from dataclasses import dataclass

from nmbus.bench.scratch import BenchOptions

#: The peers ``python -m bench peers`` can measure beside nmbus.
PEERS = ("pgqueuer", "graphile-worker")


@dataclass
class Options(BenchOptions):
    """:class:`~nmbus.bench.scratch.BenchOptions`, and what fanout, delivery and peers take."""

    subscribers: int = 3
    publishers: int = 8
    fanout_messages: int = 10_000
    fanout_batch: int = 500
    sequences: int = 50
    sequence_members: int = 1_000
    #: peers: the peers measured beside nmbus (of PEERS), each where it is installed.
    peers: tuple[str, ...] = PEERS
