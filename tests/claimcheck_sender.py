"""A sender that dies between a claim-check payload's write and its message's commit.

    python -m tests.claimcheck_sender <dsn> <store URL or "table"> <body bytes>

Sends one message to queue ``media`` with a body over ``claim_check_bytes``,
in a transaction of its own connection (docs/outbox.md: the message exists when
that transaction commits), then prints ``sent <unique id>`` and waits there for
ever, the transaction open: the test SIGKILLs it. With a store the payload's
file is written before the send returns; with the table, its row is written by
the send's statement, in the open transaction.
"""

from __future__ import annotations

import asyncio
import sys

import asyncpg

from nmbus import Bus, Message


class Blob(Message, type_name="test.cc.Blob"):
    data: str


async def main(dsn: str, store: str, size: int) -> None:
    extra = {} if store == "table" else {"claim_check_store": store}
    bus = Bus("media_sender", dsn=dsn, concurrency=0, claim_check_bytes=1000, **extra)
    async with bus:
        conn = await asyncpg.connect(dsn)
        tx = conn.transaction()
        await tx.start()
        unique_id = await bus.send(Blob(data="z" * size), to="media", connection=conn)
        print(f"sent {unique_id}", flush=True)
        while True:
            await asyncio.sleep(60)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
