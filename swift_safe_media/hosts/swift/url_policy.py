"""``swift deploy``: the addresses a request's media URL may be fetched from.

A media URL in a request is fetched by the server, from inside its network: pointed at
``127.0.0.1``, a private host or the cloud metadata endpoint, it turns the server into the
caller's proxy (SSRF). While serving, every hop of a media URL's download (the URL, then
each redirect) is checked here before it is fetched:

- the host is resolved (``getaddrinfo``, as the connection would: ``2130706433`` and
  ``0177.0.0.1`` are ``127.0.0.1``), and the hop is refused if **any** of its addresses is
  internal (:func:`internal_kind`: loopback, private, carrier-grade NAT, link-local,
  unspecified, multicast, reserved, or an IPv6 form that carries one of those: IPv4-mapped,
  6to4, NAT64), unless ``SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS`` names the host or a network
  holding that address (:func:`allowed`); the cloud metadata endpoints (:data:`METADATA`)
  are refused even then;
- the hop's download then connects only to the addresses checked (:func:`pinned_handlers`,
  used in the download's sandbox), so a name that resolves elsewhere a moment later (DNS
  rebinding) is not asked again; where a proxy serves the URL, the proxy connects instead.

A refusal is a :class:`~swift_safe_media.errors.MediaDecodeError` naming the URL the request
sent, so the request gets its HTTP 400 (:mod:`.serving`). Training never checks: its
datasets legitimately live on internal hosts.
"""

from __future__ import annotations

import dataclasses
import http.client
import ipaddress
import socket
import urllib.parse
import urllib.request

from ... import config
from ...errors import MediaDecodeError

SETTING = config.SERVE_ALLOW_HOSTS

_V4 = tuple((ipaddress.ip_network(network), kind) for network, kind in (
    ("0.0.0.0/8", "an unspecified address"),  # "this network": connecting to 0.0.0.0 reaches this host
    ("127.0.0.0/8", "a loopback address"),
    ("10.0.0.0/8", "a private address"), ("172.16.0.0/12", "a private address"),
    ("192.168.0.0/16", "a private address"),
    ("100.64.0.0/10", "a carrier-grade NAT address"),
    ("169.254.0.0/16", "a link-local address"),
    ("224.0.0.0/4", "a multicast address"),
    ("240.0.0.0/4", "a reserved address"),  # 255.255.255.255 too
))
_V6 = tuple((ipaddress.ip_network(network), kind) for network, kind in (
    ("::/128", "an unspecified address"),
    ("::1/128", "a loopback address"),
    ("::/96", "a reserved address"),  # IPv4-compatible (deprecated)
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a private address"),  # site-local (deprecated)
    ("fc00::/7", "a private address"),  # unique local, fd00::/8 included
    ("64:ff9b:1::/48", "a private address"),  # NAT64 for local use
    ("ff00::/8", "a multicast address"),
))
# Forms of IPv6 address that carry an IPv4 address, which the connection may reach.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Cloud instance metadata endpoints (they hand out the instance's credentials): refused even
# where the setting names them or a network around them. AWS, Azure, GCP and others; AWS
# ECS task credentials; AWS over IPv6; Alibaba Cloud.
METADATA = frozenset(ipaddress.ip_address(address) for address in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200"))


def internal_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What kind of internal address ``ip`` is ("a loopback address", ...), None for a
    public one. An IPv6 address that carries an IPv4 one is judged by the IPv4 one."""
    embedded, form = _embedded_ipv4(ip)
    kind = _kind(ip if embedded is None else embedded)
    notes = ([f"the {form} form of {embedded}"] if embedded is not None else []) + \
        (["a cloud metadata endpoint"] if _is_metadata(ip) else [])
    return kind if kind is None or not notes else f"{kind} ({', '.join(notes)})"


def _kind(ip) -> str | None:
    kind = next((kind for network, kind in (_V4 if ip.version == 4 else _V6) if ip in network), None)
    if kind is None and (not ip.is_global or ip.is_reserved):
        kind = "a reserved address"
    return kind


def _embedded_ipv4(ip):
    if ip.version == 4:
        return None, ""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "IPv4-mapped"
    if ip.sixtofour is not None:
        return ip.sixtofour, "6to4"
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "NAT64"
    return None, ""


def _is_metadata(ip) -> bool:
    embedded, _ = _embedded_ipv4(ip)
    return ip in METADATA or embedded in METADATA


# --- the setting: hosts and networks allowed ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class Allowed:
    """What ``SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS`` lets through: host names (a URL whose
    host is one of them, whatever it resolves to) and networks (addresses inside them)."""
    names: frozenset = frozenset()
    networks: tuple = ()

    def admits(self, host: str, ip) -> bool:
        if host in self.names:
            return True
        embedded, _ = _embedded_ipv4(ip)
        return any(address is not None and address.version == network.version and address in network
                   for network in self.networks for address in (ip, embedded))


def allowed() -> Allowed:
    """The setting, parsed: each entry a host name, an IP address or a CIDR network
    (``10.0.0.0/8``, ``fd00::/8``, ``[::1]``); ValueError naming the variable for an entry
    that is none of them (a port, a malformed network)."""
    names, networks, entries = set(), [], config.get(SETTING)
    for entry in entries:
        text = entry.strip().lower().rstrip(".")
        text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        try:
            networks.append(ipaddress.ip_network(text, strict=False))  # an address: a network of one
        except ValueError as exc:
            if "/" in text or ":" in text:
                raise ValueError(f"{SETTING}={','.join(entries)!r}: {entry!r} is not a host name, an IP address "
                                 f"or a CIDR network (no port): {exc}") from None
            names.add(text)
    return Allowed(frozenset(names), tuple(networks))


# --- a hop checked ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Checked:
    """A hop that may be fetched: the addresses checked (the connection's only ones), and
    whether the setting let an internal one through."""
    addresses: tuple[str, ...]
    internal: bool


def check(url: str, requested: str | None = None) -> Checked:
    """Check one hop of a download, ``url``, of the request's ``requested`` URL (the same
    for the first hop); MediaDecodeError naming ``requested`` where it is refused."""
    requested = requested or url
    where = "" if url == requested else f"redirected to {url}, which "
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:  # a malformed [IPv6] host
        raise MediaDecodeError(requested, f"{where or 'it '}is not a valid URL ({exc}); refused when serving") from None
    host = (parts.hostname or "").rstrip(".").lower()
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise MediaDecodeError(requested, f"{where or 'it '}is not an http(s) URL with a host; refused when serving")
    addresses = _resolve(requested, where, host)
    policy, internal = allowed(), False
    for ip in addresses:
        kind = internal_kind(ip)
        if kind is None:
            continue
        if policy.admits(host, ip) and not _is_metadata(ip):
            internal = True
            continue
        rule = ("cloud metadata endpoints are refused when serving, listed or not" if _is_metadata(ip) else
                f"internal addresses are refused when serving ({SETTING})")
        raise MediaDecodeError(requested, f"{where}resolves to {ip}, {kind}; {rule}")
    return Checked(tuple(str(ip) for ip in addresses), internal)


def _resolve(requested: str, where: str, host: str) -> list:
    """Every address ``host`` resolves to (the connection may take any of them)."""
    try:
        return [ipaddress.ip_address(host.split("%", 1)[0])]
    except ValueError:
        pass  # a name, or an IPv4 address spelled as getaddrinfo alone reads it (2130706433)
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise MediaDecodeError(requested, f"{where}names the host {host!r}, which does not resolve ({exc})") from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in found))
    if not addresses:
        raise MediaDecodeError(requested, f"{where}names the host {host!r}, which resolves to no address")
    return addresses


# --- in the download's sandbox: connect to the addresses checked ---------------------------

def pinned_handlers(url: str, addresses) -> list:
    """urllib handlers whose connections go to ``addresses`` (the hop's checked ones, in
    turn) instead of resolving the host again; the host still names the request (``Host``,
    TLS server name and certificate check). None where a proxy serves ``url``: the proxy
    connects, and is connected to, as urllib would."""
    request = urllib.request.Request(url)
    proxies = urllib.request.getproxies()
    if not addresses or (request.type in proxies and not urllib.request.proxy_bypass(request.host)):
        return []
    return [_PinnedHTTP(tuple(addresses)), _PinnedHTTPS(tuple(addresses))]


class _PinnedHTTP(urllib.request.HTTPHandler):
    def __init__(self, addresses):
        super().__init__()
        self.addresses = addresses

    def http_open(self, req):
        return self.do_open(_pinned(http.client.HTTPConnection, self.addresses), req)


class _PinnedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, addresses):
        super().__init__()
        self.addresses = addresses

    def https_open(self, req):
        return self.do_open(_pinned(http.client.HTTPSConnection, self.addresses), req, context=self._context)


def _pinned(connection_class, addresses):
    def connection(host, **kwargs):
        made = connection_class(host, **kwargs)
        made._create_connection = lambda address, *args: _connect_first(addresses, address[1], *args)
        return made
    return connection


def _connect_first(addresses, port, *args):
    error = None
    for address in addresses:
        try:
            return socket.create_connection((address, port), *args)
        except OSError as exc:
            error = exc
    raise error
