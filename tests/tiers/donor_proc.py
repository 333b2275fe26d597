"""A donor process for the donated tier's tests: `python -m tests.tiers.donor_proc SOCKET`, then one JSON command a
line on stdin, one JSON reply a line on stdout.

    {"cmd": "donate", "bytes": N, "name": S}              -> {"region": id}
    {"cmd": "scribble", "region": id, "offset": o, "nbytes": n, "byte": b}   writes over lent memory
    {"cmd": "peek", "region": id, "offset": o, "nbytes": n}                  -> {"crc": CRC-32C of those bytes}
    {"cmd": "reclaim", "region": id, "deadline_ms": d, "reuse": bool}        -> the daemon's reply; with `reuse`,
                                                                               the donor writes its memory at once
    {"cmd": "exit"}
A refusal answers {"error": code, "message": text}.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from kvstore.checksum import crc32c
from kvstore.client.connection import KVStoreError
from kvstore.client.donor import Donor


def handle(donor: Donor, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["cmd"]
    if op == "donate":
        return {"region": donor.donate_memfd(cmd["bytes"], cmd.get("name", "test"))}
    if op == "scribble":
        mm, o, n = donor.memory(cmd["region"]), cmd["offset"], cmd["nbytes"]
        mm[o:o + n] = bytes([cmd.get("byte", 0xAA)]) * n
        return {"ok": True}
    if op == "peek":
        mm, o, n = donor.memory(cmd["region"]), cmd["offset"], cmd["nbytes"]
        return {"crc": crc32c(mm[o:o + n])}
    if op == "reclaim":
        reply = donor.reclaim(cmd["region"], cmd["deadline_ms"] / 1000)
        if cmd.get("reuse"):
            mm = donor.memory(cmd["region"])
            mm[:] = b"\x55" * len(mm)           # the memory is the donor's again: used at once
        return reply
    if op == "exit":
        return {"ok": True}
    raise ValueError(op)


def main() -> None:
    donor = Donor(sys.argv[1])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = handle(donor, cmd)
        except KVStoreError as e:
            out = {"error": e.code, "message": e.message}
        print(json.dumps(out), flush=True)
        if cmd["cmd"] == "exit":
            break
    donor.close()


if __name__ == "__main__":
    main()
