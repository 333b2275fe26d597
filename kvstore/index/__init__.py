"""The index: the daemon's books. Which key lives in which host slot, who pins or reserves it, which namespaces
exist; it decides nothing about bytes and moves none (see `books`)."""
