"""native/kvbind.c, the bind guard the daemon preloads for Mooncake's transfer engine: an armed thread's binds to the
any-address land on the armed address (IPv4, and IPv6 as a v4-mapped address), every other bind is left as asked —
other threads', explicit addresses', and all binds once disarmed. Run in a child process started with the library
preloaded, as `kvstore serve` starts itself (kvstore.tiers.remote.address)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvstore.tiers.remote.address import _address, is_loopback, library_path, listen_address

CHILD = r"""
import errno, json, socket, threading
from kvstore.tiers.remote.address import armed, guard_loaded, _guard

def bound(family=socket.AF_INET, host="0.0.0.0"):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        return s.getsockname()[0]
    except OSError as e:
        return errno.errorcode[e.errno]
    finally:
        s.close()

out = {"loaded": guard_loaded(), "before": bound()}
with armed("127.0.0.1"):
    out["v4"] = bound()
    out["v6"] = bound(socket.AF_INET6, "::")
    out["explicit"] = bound(host="127.0.0.2")
    other = []
    t = threading.Thread(target=lambda: other.append(bound()))
    t.start(); t.join()
    out["other_thread"] = other[0]
out["after"] = bound()
with armed("::1"):
    out["v4_armed_v6"] = bound()
    out["v6_armed_v6"] = bound(socket.AF_INET6, "::")
out["rewrites"] = _guard().kvbind_rewrites()
print(json.dumps(out))
"""


@pytest.mark.skipif(library_path() is None, reason="the bind guard was not built (no C compiler at install)")
def test_an_armed_thread_binds_the_armed_address_and_nothing_else_changes() -> None:
    env = {**os.environ, "LD_PRELOAD": str(library_path())}
    env.pop("KVSTORE_BIND_ANY_TO", None)
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    assert out["loaded"] is True
    assert out["before"] == "0.0.0.0" and out["after"] == "0.0.0.0"          # unarmed: as asked
    assert out["v4"] == "127.0.0.1"                                          # armed: narrowed
    assert out["v6"] == "::ffff:127.0.0.1"                                   # dual-stack, IPv4 connections only
    assert out["explicit"] == "127.0.0.2"                                    # an address named is kept
    assert out["other_thread"] == "0.0.0.0"                                  # only the armed thread
    assert out["v4_armed_v6"] == "EADDRNOTAVAIL"                             # refused rather than everywhere
    assert out["v6_armed_v6"] == "::1"
    assert out["rewrites"] == 3


ENV_CHILD = r"""
import json, socket, threading
from kvstore.tiers.remote.address import armed

def bound():
    s = socket.socket(); s.bind(("0.0.0.0", 0)); a = s.getsockname()[0]; s.close(); return a

other = []
t = threading.Thread(target=lambda: other.append(bound())); t.start(); t.join()
with armed("127.0.0.2"):
    mine = bound()
print(json.dumps({"main": bound(), "other": other[0], "armed": mine}))
"""


@pytest.mark.skipif(library_path() is None, reason="the bind guard was not built (no C compiler at install)")
def test_kvstore_bind_any_to_narrows_every_thread_never_armed() -> None:
    """For a process kvstore does not control (a baseline's Mooncake client): every thread binds the any-address
    to KVSTORE_BIND_ANY_TO, unless it arms the guard itself."""
    env = {**os.environ, "LD_PRELOAD": str(library_path()), "KVSTORE_BIND_ANY_TO": "127.0.0.1"}
    out = json.loads(subprocess.run([sys.executable, "-c", ENV_CHILD], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    assert out == {"main": "127.0.0.1", "other": "127.0.0.1", "armed": "127.0.0.2"}


def test_without_the_library_loaded_arming_changes_nothing() -> None:
    from kvstore.tiers.remote.address import armed, guard_loaded

    if guard_loaded():
        pytest.skip("this process runs with the guard preloaded")
    with armed("127.0.0.1") as narrowed:
        assert narrowed is False


def test_addresses_read_from_proc_net_tcp() -> None:
    assert _address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _address("00000000:0050") == ("0.0.0.0", 80)
    assert _address("0000000000000000FFFF00000100007F:1F90") == ("127.0.0.1", 8080)     # v4-mapped
    assert _address("00000000000000000000000001000000:0016") == ("::1", 22)
    assert _address("00000000000000000000000000000000:0016") == ("::", 22)


def test_where_the_ports_listen() -> None:
    assert listen_address("127.0.0.1", "") == "127.0.0.1"            # the advertised address only
    assert listen_address("10.0.0.2", "10.1.0.2") == "10.1.0.2"      # another of this node's addresses
    assert listen_address("10.0.0.2", "0.0.0.0") is None             # every address, on purpose
    assert listen_address("10.0.0.2", "::") is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("192.0.2.2") and not is_loopback("0.0.0.0")
