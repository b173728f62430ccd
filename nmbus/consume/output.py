"""What a batch stores beside its outcomes, in its transaction: what its handlers
sent and published, and the failure port's copies of the messages going to F."""

from __future__ import annotations

from collections import defaultdict

import structlog

from nmbus.context import Effects
from nmbus.envelopes import chain_of, dead_letter_copy
from nmbus.messages import Envelope, StoredMessage
from nmbus.ports.store import Batch, Outcomes

log = structlog.get_logger("nmbus.worker")


async def copy_failed(
    tx: Batch, queue: str, dead_letter: str, batch: list[StoredMessage], outcomes: Outcomes
) -> None:
    """Store a copy of every row of ``queue`` going to F in the failure port, in ``tx``."""
    rows = {m.id: m for m in batch}
    made = [
        dead_letter_copy(
            queue,
            m.id,
            m.unique_id,
            m.label,
            m.msg_text,
            m.msg_headers,
            m.correlation_id,
            outcomes.error_info[i],
        )
        for i, id in enumerate(outcomes.ids)
        if outcomes.subqueue[i] == "F" and (m := rows.get(id)) is not None
    ]
    # A failure port's copy that fails in turn stays in F here, uncopied.
    copies = [c for c in made if c is not None]
    if copies:
        await tx.insert(dead_letter, queue, copies)


async def store_effects(tx: Batch, queue: str, done: list[Effects]) -> None:
    """Store what the handlers of a batch of ``queue`` sent and published, in ``tx``."""
    by_queue: dict[str, list[Envelope]] = defaultdict(list)
    published: list[Envelope] = []
    for effects in done:
        for to, envelope in effects.sends:
            by_queue[to].append(envelope)
        published.extend(effects.publishes)
    for to, envelopes in by_queue.items():
        await tx.insert(to, queue, envelopes)
    if published:
        copies = await tx.publish(queue, published, [chain_of(e) for e in published])
        if not copies:
            log.info("published_without_subscribers", queue=queue, messages=len(published))
