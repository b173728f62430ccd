"""A small shop: orders, billing and shipping exchange events by publish/subscribe.

Each service is its own process and defines the messages it uses itself: they
agree on type names ("shop.OrderPlaced"), not on Python modules.
"""
