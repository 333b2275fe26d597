"""The admin role and tenants against a live daemon (issue 13, parts 1 and 3): a client that is not an admin cannot
resize, evict or list another connection's keys; a tenant cannot map, list or hit another tenant's blocks, even of
the same model and hashes, nor speak as another tenant without its secret."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvstore.client import Client, KVStoreError
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_settled

NOT_ME = 4242 if os.getuid() != 4242 else 4343      # an admin uid that is not the test's
TENANTS = [{"name": "a", "secret": "secret-a"}, {"name": "b", "secret": "secret-b"}]


def tenant_daemon(tmp_path: Path, daemons: list[DaemonProc], admin: bool, **env: str) -> DaemonProc:
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({"tenants": TENANTS}))
    if not admin:
        env["KVSTORE_SERVER_ADMIN_UIDS"] = f"[{NOT_ME}]"
    d = DaemonProc(env={"KVSTORE_CONFIG": str(conf), **env}).start()
    daemons.append(d)
    return d


def forbidden(call, *args, **kw) -> str:
    with pytest.raises(KVStoreError) as e:
        call(*args, **kw)
    assert e.value.code == "forbidden", e.value
    return e.value.message


def test_a_client_that_is_not_an_admin_cannot_resize_evict_or_list_others_keys(start_daemon):
    """Before, resize and evict were open to every client (`resize 2**63` lifted the cap, `resize ssd 1MiB` wiped
    the SSD tier) and `list ns=N` gave any namespace's hashes and slots."""
    d = start_daemon(env={"KVSTORE_SERVER_ADMIN_UIDS": f"[{NOT_ME}]"})
    with d.client() as owner, d.client() as other:
        ns = owner.namespace(spec())
        assert ns.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        assert "server.admin_uids" in forbidden(other.resize, 1 << 40)
        assert "server.admin_uids" in forbidden(other.resize, 1 << 20, "ssd")
        assert "server.admin_uids" in forbidden(other.evict, everything=True)
        assert "server.admin_uids" in forbidden(other.list, ns.id)
        assert len(owner.list(ns.id)["keys"]) == 4              # its own namespace: listed
        s = other.stats()                                       # open to all: it shows no key
        assert s["tiers"][0]["capacity_bytes"] == 16 << 20 and s["blocks"] == 4
        assert s["errors"]["forbidden"] == 4
        outs = [bytearray(GEOM.full_bytes) for _ in range(4)]   # nothing was evicted
        assert ns.get(hashes(4), outs) == 4 and [bytes(o) for o in outs] == [block(i) for i in range(4)]
    for args in (["resize", "32MiB"], ["evict", "--all"]):     # the CLI says why, and exits 1
        r = subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1, r
        assert r.stderr.startswith("kvstore: refused by the daemon: ") and "server.admin_uids" in r.stderr
        assert "Traceback" not in r.stderr


def test_two_tenants_cannot_map_list_or_hit_each_others_blocks(tmp_path, daemons):
    d = tenant_daemon(tmp_path, daemons, admin=False)
    hs = hashes(8)
    with Client(d.socket, tenant="a", secret="secret-a") as a, Client(d.socket, tenant="b", secret="secret-b") as b:
        ns_a, ns_b = a.namespace(spec()), b.namespace(spec())   # the same model, geometry and hashes
        assert ns_a.id != ns_b.id
        assert ns_a.put(hs, [block(i) for i in range(8)]).stored == 8
        assert ns_b.lookup(hs) == 0                              # no hit on A's blocks
        assert ns_b.get(hs, [bytearray(GEOM.full_bytes) for _ in hs]) == 0
        assert ns_b.put(hs, [block(100 + i) for i in range(8)]).stored == 8   # B's own, not "exists"
        a_live = a.call("segments", ids=[])["live"]
        b_live = b.call("segments", ids=[])["live"]
        assert a_live and b_live and not set(a_live) & set(b_live)   # each tenant its own segments
        reply, fds = b._roundtrip("segments", {"ids": a_live}, want_fds=True)
        assert fds == [] and reply["segments"] == []            # B gets no fd of A's segments
        assert [n["id"] for n in b.list()["namespaces"]] == [ns_b.id]   # nor sees A's namespaces
        forbidden(b.list, ns_a.id)                              # nor A's keys
        rows = b.stats()["tiers"][0]["classes"]                 # nor A's name in the pool's rows
        assert rows and {r["tenant"] for r in rows} == {"b"}
        for ns, base in ((ns_a, 0), (ns_b, 100)):               # each reads its own bytes
            outs = [bytearray(GEOM.full_bytes) for _ in hs]
            assert ns.get(hs, outs) == 8 and [bytes(o) for o in outs] == [block(base + i) for i in range(8)]
        # a connection's tenant is fixed at its first hello
        assert "first hello" in forbidden(a.call, "hello", tenant="b", secret="secret-b")


@pytest.mark.parametrize("tenant, secret, fragment", [
    ("a", "secret-b", "wrong secret for tenant 'a'"),
    ("a", None, "wrong secret for tenant 'a'"),
    ("c", "secret-a", "tenant 'c' is not configured"),
])
def test_a_tenant_needs_its_secret(tmp_path, daemons, tenant, secret, fragment):
    d = tenant_daemon(tmp_path, daemons, admin=True)
    message = forbidden(Client, d.socket, tenant=tenant, secret=secret)
    assert fragment in message
    with Client(d.socket, tenant="a", secret="secret-a") as a:   # the daemon serves on
        assert a.namespace(spec()).put(hashes(1), [block(0)]).stored == 1


def test_a_tenant_allowed_only_to_other_users_is_refused(tmp_path, daemons):
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({"tenants": [{"name": "theirs", "uids": [NOT_ME]}]}))
    d = DaemonProc(env={"KVSTORE_CONFIG": str(conf)}).start()
    daemons.append(d)
    assert f"uid {os.getuid()} may not speak as tenant 'theirs'" in forbidden(Client, d.socket, tenant="theirs")


def test_the_tenant_comes_from_the_environment_and_the_default_tenant_keeps_digests(tmp_path, daemons, monkeypatch):
    d = tenant_daemon(tmp_path, daemons, admin=True)
    with Client(d.socket, tenant="a", secret="secret-a") as a, Client(d.socket) as plain, d.client() as admin:
        ns_a = a.namespace(spec())
        assert ns_a.put(hashes(2), [block(0), block(1)]).stored == 2
        ns = plain.namespace(spec())                            # no tenant named: the default tenant ""
        assert plain.call("hello")["tenant"] == ""
        assert [n["id"] for n in plain.list()["namespaces"]] == [ns.id]   # no admin: its own tenant's only
        digests = {n["id"]: n["digest"] for n in admin.list()["namespaces"]}
        assert digests[ns.id] == spec().digest().hex()          # as before tenants: SSD records stay readable
        assert digests[ns_a.id] != spec().digest().hex()
        assert ns.lookup(hashes(2)) == 0
    monkeypatch.setenv("KVSTORE_TENANT", "a")
    monkeypatch.setenv("KVSTORE_TENANT_SECRET", "secret-a")
    with Client(d.socket) as again:                             # KVSTORE_TENANT / KVSTORE_TENANT_SECRET
        ns = again.namespace(spec())
        outs = [bytearray(GEOM.full_bytes) for _ in range(2)]
        assert ns.get(hashes(2), outs) == 2 and [bytes(o) for o in outs] == [block(0), block(1)]


def test_a_tenants_blocks_on_ssd_stay_its_own(tmp_path, daemons):
    d = tenant_daemon(tmp_path, daemons, admin=True, KVSTORE_SSD_DIR=str(tmp_path / "ssd"))
    hs, want = hashes(16), [block(i) for i in range(16)]
    with Client(d.socket, tenant="a", secret="secret-a") as a, Client(d.socket, tenant="b", secret="secret-b") as b:
        ns_a, ns_b = a.namespace(spec()), b.namespace(spec())
        assert ns_a.put(hs, want).stored == 16
        with d.client() as admin:                               # uid and admin secret: every block goes to SSD
            admin.evict(everything=True)
            ssd_settled(admin)
            listing = admin.list()                              # the admin sees both tenants
        assert ns_b.lookup(hs) == 0                             # no hit from SSD either
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns_a.get(hs, outs) == 16 and [bytes(o) for o in outs] == want
        assert {n["tenant"] for n in listing["namespaces"]} == {"a", "b"}
        assert {n["tenant"] for n in a.list()["namespaces"]} == {"a"}    # the daemon's uid alone: no admin
    r = subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, "ls"], capture_output=True, text=True,
                       env=d.cli_env(), timeout=60)
    rows = [line.split()[:3] for line in r.stdout.splitlines()[2:]]
    assert r.stdout.split()[:3] == ["ns", "tenant", "model"]
    assert [t for _, t, _ in rows] == ["a"]                     # b's namespace, empty and unused, was forgotten


def test_a_delete_of_blocks_below_races_no_get_into_bringing_them_back(tmp_path, daemons):
    """op_delete deletes from the lower tiers without the state lock: a get of the same keys meanwhile must not
    promote them back into the host pool."""
    d = DaemonProc(env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd")}).start()
    daemons.append(d)
    hs, want = hashes(64), [block(i) for i in range(64)]
    with d.client() as c, d.client() as reader:
        ns, theirs = c.namespace(spec()), reader.namespace(spec())
        assert ns.put(hs, want).stored == 64
        c.evict(everything=True)
        ssd_settled(c)
        stop = threading.Event()
        bad: list[str] = []

        def read() -> None:
            while not stop.is_set():
                outs = [bytearray(GEOM.full_bytes) for _ in hs]
                n = theirs.get(hs, outs)
                if [bytes(o) for o in outs[:n]] != want[:n]:
                    bad.append("wrong bytes")

        t = threading.Thread(target=read)
        t.start()
        try:
            assert sum(ns.delete([h]) for h in hs) == 64
        finally:
            stop.set()
            t.join()
        assert bad == []
        ssd_settled(c)
        assert sum(ns.lookup([h]) for h in hs) == 0                # gone from every tier, none brought back


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user (as_nobody)")


def as_nobody(d: DaemonProc, act: Callable[[Client], dict[str, object]], open_up: bool = True) -> dict[str, object]:
    """Run `act` with a client of the daemon in a forked child that setuid()s to nobody; what it returned (or the
    error it raised, as {"error": repr}), through a pipe. `open_up` opens the socket and its directories to every
    user first (tests only); without it the daemon's own modes decide. Tests using it are marked `needs_root`."""
    import json

    for path, mode in ((d.dir, 0o755), (os.path.dirname(d.socket), 0o755), (d.socket, 0o666)) if open_up else ():
        os.chmod(path, mode)                                  # let the other user reach the socket (tests only)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:                                              # the child: nobody
        out: dict[str, object] = {}
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            with Client(d.socket) as c:
                out = act(c)
        except BaseException as e:  # noqa: BLE001 - said to the parent, which fails the test
            out["error"] = repr(e)
        finally:
            os.write(write_end, json.dumps(out).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        out = json.loads(f.read() or "{}")
    os.waitpid(pid, 0)
    return out


@needs_root
def test_another_user_gets_a_tenant_of_its_own_and_no_admin_role(start_daemon):
    """A second uid (a forked child that setuid()s to nobody), with nothing configured: the kernel's credentials
    give it tenant uid:65534, no admin role, and none of the daemon user's segments or blocks."""
    d = start_daemon()
    with d.client() as root:
        mine = root.namespace(spec())
        assert mine.put(hashes(4), [block(i) for i in range(4)]).stored == 4
        root_live = root.call("segments", ids=[])["live"]

        def act(c: Client) -> dict[str, object]:
            out: dict[str, object] = {"tenant": c.call("hello")["tenant"]}
            ns = c.namespace(spec())
            out["hit"] = ns.lookup(hashes(4))
            out["fds"] = len(c._roundtrip("segments", {"ids": root_live}, want_fds=True)[1])
            out["listed"] = [n["tenant"] for n in c.list()["namespaces"]]
            for name, call in (("resize", lambda: c.resize(1 << 40)), ("evict", lambda: c.evict(1 << 20))):
                try:
                    call()
                    out[name] = "ok"
                except KVStoreError as e:
                    out[name] = e.code
            return out

        out = as_nobody(d, act)
        assert out == {"tenant": "uid:65534", "hit": 0, "fds": 0, "listed": ["uid:65534"], "resize": "forbidden",
                       "evict": "forbidden"}
        outs = [bytearray(GEOM.full_bytes) for _ in range(4)]
        assert mine.get(hashes(4), outs) == 4 and [bytes(o) for o in outs] == [block(i) for i in range(4)]


@needs_root
def test_a_daemon_refusing_unknown_tenants_refuses_another_user(start_daemon):
    """tenancy.unknown: refuse — a uid no tenant lists (a forked child as nobody) is refused at hello with the
    setting named; the daemon's own user is still served."""
    d = start_daemon(env={"KVSTORE_TENANCY_UNKNOWN": "refuse"})

    def act(c: Client) -> dict[str, object]:
        try:
            c.namespace(spec())
            return {"hello": "ok"}
        except KVStoreError as e:
            return {"hello": e.code, "message": e.message}

    out = as_nobody(d, act)
    assert out.get("hello") == "forbidden" and "tenancy.unknown: refuse" in str(out.get("message")), out
    with d.client() as c:
        assert c.namespace(spec()).put(hashes(2), [block(0), block(1)]).stored == 2
