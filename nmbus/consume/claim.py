"""One claim: the batch one statement leased, under a token no other claim uses.

Every claim statement leases its rows to a token of its own (``Claims.token``:
the process's client id, a random part drawn each time the worker starts (a
process forked after its Bus was built draws its own), the loop, a number),
kept in ``handling_client_id``.
Every later statement on those rows names the token: a finish, a renewal, a
give-back or a lease-lost decision changes only rows still leased by the claim
that took them. A row whose lease lapsed and that another claim took since,
in another process or in a loop of this one, is that claim's alone.

A :class:`Claim` owns what became of its rows so far: which handlers started
(their attempt counted for real) and which outcomes are committed (never run
again). A loop's batch fills them in; nothing else edits them. It also knows,
by this process's clock, until when its lease surely holds: from just before
the statement that leased it, and from just before each renewal that reached
it. A message is never started once that time has passed, since another claim
may run it already.

:class:`Claims` is one worker's set of live claims: what its lease renewer
renews and what its stop lets go of. A loop takes a claim in when the
statement that leased it returns and lets it out when the batch has ended.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterator

from nmbus.messages import StoredMessage


class Claim:
    """The rows of one claim, its token, and what became of each so far."""

    __slots__ = ("committed", "lease_until", "rows", "skipped", "started", "token")

    def __init__(self, token: str, rows: list[StoredMessage], lease_until: float) -> None:
        self.token = token
        self.rows = rows
        #: Ids whose handlers started under this claim (their attempt counts).
        self.started: set[int] = set()
        #: Ids whose outcome a commit of this claim recorded: never run again.
        self.committed: set[int] = set()
        #: Rows not started because the lease may have lapsed, to give back.
        self.skipped: list[StoredMessage] = []
        #: time.monotonic() until which the lease surely holds.
        self.lease_until = lease_until

    def __repr__(self) -> str:
        return f"Claim({self.token!r}, {len(self.rows)} rows)"

    @property
    def ids(self) -> list[int]:
        return [m.id for m in self.rows]

    def open_ids(self) -> list[int]:
        """The rows whose outcome is not committed yet (their leases still matter)."""
        return [m.id for m in self.rows if m.id not in self.committed]

    def suspects(self) -> set[int]:
        """The rows a crash left (recovered): let go unstarted, they stay suspects."""
        return {m.id for m in self.rows if m.recovered}

    def lapsed(self) -> bool:
        """Whether the lease may have run out: another claim may hold the rows now."""
        return time.monotonic() >= self.lease_until

    def renewed(self, sent_at: float, lease: float) -> None:
        """A renewal sent at ``sent_at`` (monotonic) extended the lease by ``lease`` s."""
        self.lease_until = max(self.lease_until, sent_at + lease)

    def narrow(self, rows: list[StoredMessage]) -> None:
        """Keep only ``rows`` (the others were let go: isolate)."""
        self.rows = rows

    def run_again(self, rows: list[StoredMessage]) -> None:
        """Keep only ``rows``, to run again afresh: their batch was rolled back (the
        server cut it short), nothing of it was visible. The rows left out are no
        longer this claim's care: their leases run out."""
        self.rows = rows
        self.started.difference_update(m.id for m in rows)
        self.skipped = []


class Claims:
    """The live claims of one worker, each taken in by the loop that claimed it."""

    def __init__(self, client_id: str, lease: float) -> None:
        self.client_id = client_id
        self.lease = lease
        self._numbers = itertools.count(1)
        self._prefix = client_id
        self._live: dict[str, Claim] = {}
        self.begin()

    def begin(self) -> None:
        """Draw the random part of the tokens anew (the worker starts)."""
        self._prefix = f"{self.client_id}/{secrets.token_hex(3)}"

    def token(self, loop: int | str) -> str:
        """A token for the next claim of ``loop``: no other claim has it."""
        return f"{self._prefix}/{loop}.{next(self._numbers)}"

    def take(self, token: str, rows: list[StoredMessage], since: float) -> Claim | None:
        """The claim ``token`` that leased ``rows`` in a statement sent at ``since``."""
        if not rows:
            return None
        claim = Claim(token, rows, since + self.lease)
        self._live[token] = claim
        return claim

    def end(self, claim: Claim) -> None:
        """The batch of ``claim`` has ended: its leases are no longer this worker's care."""
        self._live.pop(claim.token, None)

    def __iter__(self) -> Iterator[Claim]:
        return iter(list(self._live.values()))

    def __len__(self) -> int:
        return len(self._live)

    def in_flight(self) -> set[int]:
        """Ids of the rows the live claims hold and have not finished."""
        return {i for claim in self._live.values() for i in claim.open_ids()}

    def leases(self) -> tuple[list[int], list[str]]:
        """What a renewal names: each open row with its claim's token."""
        ids: list[int] = []
        tokens: list[str] = []
        for claim in self._live.values():
            open_ids = claim.open_ids()
            ids.extend(open_ids)
            tokens.extend([claim.token] * len(open_ids))
        return ids, tokens

    def lapsed_leases(self) -> tuple[list[int], list[str]]:
        """As ``leases``, of the live claims whose lease may have lapsed by the clock."""
        ids: list[int] = []
        tokens: list[str] = []
        for claim in self._live.values():
            if claim.lapsed():
                open_ids = claim.open_ids()
                ids.extend(open_ids)
                tokens.extend([claim.token] * len(open_ids))
        return ids, tokens

    def renewed(self, ids: set[int], sent_at: float) -> None:
        """Rows ``ids`` were renewed by a statement sent at ``sent_at``: a claim all of
        whose open rows were is sure of its lease from then (one skipped, locked by
        a finish of its own that may yet roll back, leaves its clock as it was)."""
        for claim in self._live.values():
            open_ids = claim.open_ids()
            if open_ids and all(i in ids for i in open_ids):
                claim.renewed(sent_at, self.lease)
