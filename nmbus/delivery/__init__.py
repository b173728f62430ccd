"""Delivery features around the one path: flow limits (:mod:`~nmbus.delivery.flow`),
subscriptions, cancellation, request/reply and periodic messages."""
