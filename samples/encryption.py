"""Encrypted fields: a card number sealed in every stored copy, read in the clear by its handler.

``CardCharged.card_number`` is ``Encrypted[str]`` (docs/messages.md). Three
senders send one order each to ``enc_billing``: the first still holds only the
old key ``k1``; the billing endpoint itself holds ``k2`` (current) and ``k1``
(kept so that old messages still open); the third encrypts with ``k0``, a key
billing no longer holds. Billing handles the first two and prints the card's
last digits; the third fails at once (``UnknownEncryptionKey``), and what the
queue table holds for it is printed: ciphertext under key id ``k0``.

The keys are made up at start; a deployment sets them once, for example
``NMBUS_ENCRYPTION_KEYS="k2:<base64>,k1:<base64>" NMBUS_ENCRYPTION_KEY_ID=k2``.

    NMBUS_DSN=postgresql://... python -m samples.encryption
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

import structlog

from nmbus import Bus, Context, Encrypted, Message
from nmbus.ops.admin import Admin
from nmbus.testing import drain


class CardCharged(Message, type_name="enc.CardCharged"):
    order_id: int
    card_number: Encrypted[str]


K0, K1, K2 = (os.urandom(32) for _ in range(3))  # AES-256 keys


billing = Bus(
    "enc_billing", encryption_keys={"k2": K2, "k1": K1}, encryption_key_id="k2", concurrency=1
)
old = Bus("enc_old_shop", encryption_keys={"k1": K1}, concurrency=0)
retired = Bus("enc_retired_shop", encryption_keys={"k0": K0}, concurrency=0)


@billing.handler
async def charge(msg: CardCharged, ctx: Context) -> None:
    print(f"order {msg.order_id}: charged the card ending {msg.card_number[-4:]}")


async def main() -> None:
    async with Admin.from_settings(billing.settings) as admin:
        await admin.create_queues(["enc_billing"])  # before anything is sent to it
    async with old, retired:
        await old.send(CardCharged(order_id=1, card_number="4111 1111 1111 1111"), to="enc_billing")
        await retired.send(
            CardCharged(order_id=3, card_number="5500 0000 0000 0004"), to="enc_billing"
        )
    async with billing:
        await billing.send(
            CardCharged(order_id=2, card_number="4012 8888 8888 1881"), to="enc_billing"
        )
        await drain(billing)
    async with Admin.from_settings(billing.settings) as admin:
        failed = (await admin.failed_messages("enc_billing"))[-1]  # this run's
        print(f"failed: {failed.error}")
        row = await admin.message("enc_billing", failed.id)
        assert row is not None and row.msg_text is not None
        stored = json.loads(row.msg_text)["card_number"]
        print(
            f"stored: key {stored['nmbus-encrypted']}, {len(stored['data'])} characters of base64"
        )


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main())
