"""Redis clients from URLs: single server, TLS, unix socket, Redis Cluster.

Supported URLs (credentials and options are passed through to redis-py unchanged)::

    redis://[user:password@]host:port[/db]            plain TCP
    rediss://[user:password@]host:port[/db]?ssl_ca_certs=/path/ca.pem   TLS
    unix://[user:password@]/path/to/redis.sock[?db=0] unix socket
    redis-cluster://[user:password@]host:port[,host:port...]   Redis Cluster (seed nodes)
    rediss-cluster://...                                       Redis Cluster over TLS

ACL users and passwords come from the URL (``user:password@``) or from ``username=`` /
``password=`` keyword arguments; any other redis-py keyword (``ssl_certfile``,
``ssl_cert_reqs``, ``socket_timeout``...) is passed through.

Defaults differ from redis-py's on purpose: short connect timeouts, and a single immediate
retry on a *connection* error (a pooled connection that died with a restarted server) but
none on a timeout (retrying a slow server only doubles the stall). Responses are always
bytes (``decode_responses=False``): payloads are binary.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from hybridcache.tiers.errors import TierConfigError

RedisClient = redis.Redis | RedisCluster

_PLAIN_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = {"redis-cluster": "redis", "rediss-cluster": "rediss"}

#: Defaults for both kinds of client; callers override any of them by keyword.
DEFAULT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 1.0,
}


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (its client connects when created)."""
    return url.split("://", 1)[0].lower() in _CLUSTER_SCHEMES


def connect(url: str, **kwargs: Any) -> RedisClient:
    """A redis-py client for ``url`` (see the module notes for the schemes).

    Raises:
        TierConfigError: unknown scheme, malformed URL, or ``decode_responses=True``.
    """
    if kwargs.get("decode_responses"):
        raise TierConfigError("decode_responses: must be False, payloads are binary")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    options = {**DEFAULT_OPTIONS, **kwargs, "decode_responses": False}
    if scheme in _PLAIN_SCHEMES:
        options.setdefault("retry", Retry(NoBackoff(), 1, (RedisConnectionError,)))
        try:
            return redis.Redis.from_url(url, **options)
        except ValueError as exc:
            raise TierConfigError(f"url {redact(url)}: {exc}") from exc
    if scheme in _CLUSTER_SCHEMES:
        return _connect_cluster(url, _CLUSTER_SCHEMES[scheme], options)
    known = ", ".join([f"{s}://" for s in (*_PLAIN_SCHEMES, *_CLUSTER_SCHEMES)])
    raise TierConfigError(f"url {redact(url)}: unknown scheme (known: {known})")


def _connect_cluster(url: str, plain_scheme: str, options: dict[str, Any]) -> RedisCluster:
    """RedisCluster from ``redis-cluster://[auth@]h1:p1,h2:p2/?opts``: the first host goes
    through redis-py's URL parser (auth, TLS, options), the others become extra seeds."""
    parts = urlsplit(url)
    auth, _, hostlist = parts.netloc.rpartition("@")
    hosts = [h for h in hostlist.split(",") if h]
    if not hosts:
        raise TierConfigError(f"url {redact(url)}: no cluster seed host")
    seeds: list[ClusterNode] = []
    for hostport in hosts[1:]:
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise TierConfigError(f"url {redact(url)}: bad seed {hostport!r} (need host:port)")
        seeds.append(ClusterNode(host, int(port)))
    first = (auth + "@" if auth else "") + hosts[0]
    single = urlunsplit((plain_scheme, first, parts.path, parts.query, parts.fragment))
    options.setdefault("retry", Retry(NoBackoff(), 1))
    try:
        return RedisCluster(url=single, startup_nodes=seeds, **options)
    except ValueError as exc:
        raise TierConfigError(f"url {redact(url)}: {exc}") from exc


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log)."""
    scheme, sep, rest = url.partition("://")
    auth, at, tail = rest.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _ = auth.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{tail}"
