"""Delivery controls (docs/delivery.md): a sequence, priority, expiry, a failure port, a tick.

NMBUS_DSN=postgresql://postgres@127.0.0.1:5432/test python -m samples.delivery

The ledger posts the entries of each account strictly in order (a sequence per
account), an urgent audit jumps the queue (priority), a quote nobody took in
time is never handled (ttl), what fails lands in F with a copy in the "errors"
endpoint (the failure port), and a periodic tick counts the postings.
"""

import asyncio
import logging

import structlog

from nmbus import Bus, Context, Message, PermanentError, Settings, Tick
from nmbus.ops.admin import Admin
from nmbus.testing import drain


class Posted(Message, type_name="ledger.Posted"):
    account: str
    entry: int
    amount: float


class Audit(Message, type_name="ledger.Audit"):
    account: str


class Quote(Message, type_name="ledger.Quote"):
    price: float


ledger = Bus("ledger", dead_letter="errors", batch_size=10)
errors = Bus("errors")
teller = Bus("teller", concurrency=0)  # sends only
teller.sends(Quote, Posted, Audit, to="ledger")  # for its contract document (nmbus asyncapi)
balances: dict[str, float] = {}


@ledger.handler
async def post(msg: Posted, ctx: Context) -> None:
    if msg.amount != msg.amount or abs(msg.amount) > 1_000_000:
        raise PermanentError(f"entry {msg.entry} of {msg.account}: amount out of range")
    balances[msg.account] = balances.get(msg.account, 0.0) + msg.amount
    print(f"{msg.account} entry {msg.entry}: balance {balances[msg.account]:.2f}")


@ledger.handler
async def audit(msg: Audit, ctx: Context) -> None:
    print(f"audit of {msg.account} (priority first)")


@ledger.handler
async def quote(msg: Quote, ctx: Context) -> None:
    print("never printed: the quote expired before any worker ran")


@ledger.periodic(every=1.0, missed="skip")
async def heartbeat(tick: Tick, ctx: Context) -> None:
    print(f"tick {tick.name} due at {tick.scheduled_at:%H:%M:%S}")


@errors.handler
async def any_failure(msg: Message, ctx: Context) -> None:  # every type: a base-class handler
    where = f"{ctx.headers['nmbus-failed-queue']} #{ctx.headers['nmbus-failed-id']}"
    print(f"failure port: {where}: {ctx.headers['nmbus-failed-error']}")


async def main() -> None:
    # The application, not the library, decides what gets logged.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    # Both queues exist before any worker runs, as a deployment makes them
    # (`nmbus queues create ledger errors`). A send to a queue no endpoint has
    # created yet creates it too, but warns (queue_created_by_send: a typo in
    # `to=`?): the teller sends to the ledger before the ledger starts, and the
    # ledger's failure port sends to errors before the errors endpoint starts.
    async with Admin.from_settings(Settings()) as admin:
        await admin.create_queues(["ledger", "errors"])
    async with teller:
        # Sent while no ledger worker runs: the quote expires before one starts.
        await teller.send(Quote(price=3.0), to="ledger", ttl=0.2)
        for entry, amount in enumerate([100.0, -30.0, 2_000_000.0, 5.0]):
            await teller.send(
                Posted(account="acct-1", entry=entry, amount=amount),
                to="ledger",
                sequence="acct-1",  # entry 3 waits for entry 2, which fails for good
            )
        for entry, amount in enumerate([10.0, 20.0]):
            await teller.send(
                Posted(account="acct-2", entry=entry, amount=amount),
                to="ledger",
                sequence="acct-2",
            )
        await teller.send(Audit(account="acct-2"), to="ledger", priority=9)
    await asyncio.sleep(0.3)
    async with ledger, errors:
        await drain(ledger)
        await drain(errors)
        await asyncio.sleep(1.2)  # long enough for one tick
        counts = await ledger.store.counts("ledger")
    print(f"ledger: {counts}; acct-1 stops at entry 2 until it is requeued or purged")


if __name__ == "__main__":
    asyncio.run(main())
