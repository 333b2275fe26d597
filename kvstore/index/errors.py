"""Requests the books cannot honour. Each message says why and what was left as it was; the daemon's protocol layer
turns each class into a status code (kvstore.daemon.session)."""


class Refused(Exception):
    """Nothing was changed; the message says why."""


class UnknownNamespace(Refused):
    """A namespace id this connection has not registered."""


class NotHeld(Refused):
    """A slot or a reservation this connection does not hold."""


class InvalidRequest(Refused):
    """Fields that contradict each other (a key twice, one checksum too few)."""


class TooLarge(Refused):
    """A block that could never fit the pool."""


class OverLimit(Refused):
    """A per-connection limit of the daemon's configuration (the message names the key)."""
