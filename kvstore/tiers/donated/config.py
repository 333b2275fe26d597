"""The donated tier's section of the configuration (`donated:`), with its checks: the tier owns it, the daemon's
configuration composes it (kvstore.daemon.config)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar


@dataclass(slots=True)
class DonatedConfig:
    """The donated tier (kvstore.tiers.donated, SwiftCache §3.2): memory an engine lends the daemon while it does not
    need it (shared memory, or GPU memory by CUDA IPC handle), a tier between the host pool and the SSD, handed back
    on the donor's demand within its deadline. Donors connect to their own socket (kvstore.client.donor)."""
    SIZES: ClassVar[tuple[str, ...]] = ("max_bytes",)     # fields given as sizes ("64GiB")
    enabled: bool = False               # off: no donated tier, no donors' socket
    socket: str = ""                    # empty: donate.sock beside server.socket
    kind: str = "memfd"                 # memfd (shared memory, any machine) | cuda (GPU memory by CUDA IPC handle)
    max_bytes: int = 0                  # all donated regions together; 0: no cap (donors lend what they have)
    max_donors: int = 16                # donor connections at once
    max_deadline_ms: int = 60000        # a reclaim asking for a longer deadline gets this one
    in_flight: int = 2                  # copies the tier's path runs at once (its worker threads)

    def check(self) -> list[str]:
        """One message per invalid field (none: valid)."""
        d = self
        errors: list[str] = []
        if d.kind not in ("memfd", "cuda"):
            errors.append(f"donated.kind: must be memfd or cuda, got {d.kind!r}")
        if d.socket and not os.path.isabs(d.socket):
            errors.append(f"donated.socket: must be an absolute path (or empty: beside server.socket), got "
                          f"{d.socket!r}")
        if not 1 <= d.max_donors <= 1024:
            errors.append(f"donated.max_donors: must be 1..1024, got {d.max_donors}")
        if not 0 <= d.max_deadline_ms <= 3_600_000:
            errors.append(f"donated.max_deadline_ms: must be 0..3600000, got {d.max_deadline_ms}")
        if not 1 <= d.in_flight <= 64:
            errors.append(f"donated.in_flight: must be 1..64, got {d.in_flight}")
        return errors
