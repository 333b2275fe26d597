"""Workflows: what the hints say about the requests to come — the hints' books (which workflows and sessions are
active, what each called last, its lookahead reuse value: `books`), the predictor of each workflow's next agent and
the gaps between its calls (`predictor`). The eviction policies (kvstore.policy), the predictive prefetch
(kvstore.movers.predictive) and the daemon's hint ops (kvstore.daemon.hints) use them; nothing here moves bytes or
evicts."""
from __future__ import annotations

from kvstore.workflows.books import Touch, Workflow, Workflows, agent_names
from kvstore.workflows.predictor import END, START

__all__ = ["END", "START", "Touch", "Workflow", "Workflows", "agent_names"]
