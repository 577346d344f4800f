"""Deployments: ACL users from the URL, unix sockets, TLS (rediss://) and Redis Cluster."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from tiers_testlib import RedisServer, assert_same, entry_for, free_port, key

from hybridcache.tiers import TenantLimits

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning"),
]


def _round_trip(tier, tenant: str = "alice", n: int = 30) -> None:
    keys = [key(tenant, i) for i in range(n)]
    for k in keys:
        assert tier.put(k, entry_for(k))
    assert tier.flush(30)
    for k, got in zip(keys, tier.get_many(keys), strict=True):
        assert_same(got, entry_for(k))
    assert tier.longest_prefix(keys) == n
    tier.delete(keys[n // 2])
    tier.flush(30)
    assert tier.longest_prefix(keys) == n // 2
    assert tier.stats().errors == 0


# ---------------------------------------------------------------------- ACL

#: The least a RedisTier needs (as docs/tiers.md lists it): tier commands, then the Lua ones.
MINIMAL_ACL = (
    "+ping +get +set +getdel +mget +unlink +exists +evalsha +script|load +zrange "
    "+time +zrangebyscore +zadd +zrem +hget +hset +hdel +hincrby"
)


@pytest.fixture
def acl_users(redis_url, redis_server):
    r = redis_server.client()
    r.execute_command("ACL", "SETUSER", "hc_engine", "on", ">engine-pw", "~hc:*", "+@all")
    r.execute_command("ACL", "SETUSER", "alice_engine", "on", ">alice-pw", "~hc:alice:*", "+@all")
    r.execute_command("ACL", "SETUSER", "hc_minimal", "reset", "on", ">min-pw", "~hc:*",
                      "resetchannels", *MINIMAL_ACL.split())  # fmt: skip
    yield redis_server.port
    r.execute_command("ACL", "DELUSER", "hc_engine", "alice_engine", "hc_minimal")


def test_acl_user_and_password_from_the_url(acl_users, make_tier):
    url = f"redis://hc_engine:engine-pw@127.0.0.1:{acl_users}/0"
    tier = make_tier(url, limits=TenantLimits(default_quota=1 << 20))
    _round_trip(tier)
    assert tier.usage("alice") > 0  # the quota script ran under the ACL user too
    assert "engine-pw" not in tier.name


def test_minimal_acl_of_the_docs_is_enough(acl_users, make_tier, redis_server):
    url = f"redis://hc_minimal:min-pw@127.0.0.1:{acl_users}"
    tier = make_tier(url, limits=TenantLimits(default_quota=1 << 20))
    _round_trip(tier)
    assert tier.reconcile_quota("alice") == 0
    k = key("alice", 3)  # corrupt one chunk: the conditional drop (Lua) runs under the ACL
    name = tier.codec.entry_key(k)
    r = redis_server.client()
    r.setrange(f"{name}:{r.get(name)[:16].decode()}:0", 5, b"xx")
    assert tier.get(k) is None
    assert tier.stats().corrupt == 1 and tier.stats().errors == 0


def test_acl_user_from_keyword_arguments(acl_users, make_tier):
    url = f"redis://127.0.0.1:{acl_users}"
    _round_trip(make_tier(url, username="hc_engine", password="engine-pw"))


def test_per_tenant_acl_confines_an_engine_to_its_tenant(acl_users, make_tier):
    tier = make_tier(f"redis://alice_engine:alice-pw@127.0.0.1:{acl_users}")
    _round_trip(tier, "alice")
    bob = key("bob", 1)
    tier.put(bob, entry_for(bob))  # NOPERM on the server: counted, not raised
    assert tier.flush(10)
    assert tier.get(bob) is None
    assert tier.stats().errors >= 1 and tier.stats().dropped_writes == 1
    assert tier.get(key("alice", 0)) is not None  # alice's entries are unaffected


def test_wrong_password_is_a_miss_not_an_exception(acl_users, make_tier):
    tier = make_tier(f"redis://hc_engine:wrong@127.0.0.1:{acl_users}")
    k = key("alice", 1)
    tier.put(k, entry_for(k))
    assert tier.flush(10)
    assert tier.get(k) is None and tier.stats().errors >= 1


# ---------------------------------------------------------------------- unix socket


def test_unix_socket_url(redis_url, redis_server, make_tier):
    tier = make_tier(redis_server.unix_url)
    _round_trip(tier)
    tcp = make_tier(redis_url)  # the same data through TCP
    assert_same(tcp.get(key("alice", 0)), entry_for(key("alice", 0)))


# ---------------------------------------------------------------------- TLS


class TlsRedisServer(RedisServer):
    """A server that only speaks TLS, with a throwaway CA."""

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        self.ca = _make_certs(workdir)
        tls = workdir / "server"
        self.extra = (
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", f"{tls}.crt",
            "--tls-key-file", f"{tls}.key",
            "--tls-ca-cert-file", str(self.ca),
            "--tls-auth-clients", "no",
        )  # fmt: skip

    @property
    def client_options(self) -> dict:
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


def _make_certs(workdir: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: cannot make test certificates")
    workdir.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=hc-test-ca",
    )
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (workdir / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext",
    )  # fmt: skip
    return workdir / "ca.crt"


def test_tls_url(tmp_path, make_tier):
    server = TlsRedisServer(tmp_path / "tls").start()
    try:
        tier = make_tier(f"rediss://127.0.0.1:{server.port}?ssl_ca_certs={server.ca}")
        _round_trip(tier)
        # Without the CA the certificate is not trusted: a miss, not an exception.
        untrusted = make_tier(f"rediss://127.0.0.1:{server.port}")
        assert untrusted.get(key("alice", 0)) is None
        assert untrusted.stats().errors >= 1
    finally:
        server.stop()


# ---------------------------------------------------------------------- Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three masters, slots split three ways, no replicas."""
    root = tmp_path_factory.mktemp("cluster")
    nodes = []
    try:
        bus_ports = [free_port() for _ in range(3)]
        for i, bus in enumerate(bus_ports):
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-port", str(bus))  # fmt: skip
            nodes.append(RedisServer(root / f"n{i}", extra=extra).start())
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for node, (lo, hi) in zip(nodes, bounds, strict=True):
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for node, bus in zip(nodes[1:], bus_ports[1:], strict=True):
            nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + 20
        while not all(_cluster_ok(n) for n in nodes):
            if time.monotonic() > deadline:
                pytest.fail("local Redis Cluster did not converge")
            time.sleep(0.05)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def _cluster_ok(node: RedisServer) -> bool:
    info = node.client().execute_command("CLUSTER", "INFO").decode()
    return "cluster_state:ok" in info and "cluster_known_nodes:3" in info


def test_redis_cluster_url(cluster, make_tier):
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in cluster[:2])
    tier = make_tier(f"redis-cluster://{seeds}", limits=TenantLimits(default_quota=1 << 20))
    _round_trip(tier, n=40)
    slots = {
        redis.cluster.key_slot(tier.codec.entry_key(key("alice", i)).encode()) for i in range(40)
    }
    assert len({s * 3 // 16384 for s in slots}) == 3  # the entries really span all three nodes
    assert tier.usage("alice") > 0
    # isolation and corruption handling hold on a cluster too
    assert tier.get(key("bob", 0)) is None
    name = tier.codec.entry_key(key("alice", 1))
    direct = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster[0].port)
    chunk = f"{name}:{direct.get(name)[:16].decode()}:0"
    direct.setrange(chunk, 10, b"garbage")
    assert tier.get(key("alice", 1)) is None
    assert direct.exists(name) == 0 and direct.exists(chunk) == 0
    assert tier.stats().corrupt == 1
    direct.close()


def test_redis_cluster_down_at_start_is_a_miss(make_tier):
    tier = make_tier(f"redis-cluster://127.0.0.1:{free_port()}")
    assert tier.get(key("alice", 1)) is None
    assert tier.stats().errors == 1
