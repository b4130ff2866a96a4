"""Attacks and hostile parties: the side channel (issues 27, 46), the `fs` store against
other local users, store keys, the proxy against hostile clients, the event log."""
