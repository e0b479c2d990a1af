"""While serving (`swift deploy`), a request's media URL that resolves to an internal address
is refused, redirects included, unless SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS allows it
(issue 42, item 3). Here: the classifier over IPv4 and IPv6 forms, the setting, the URL
spellings the resolver reads, and the download hop by hop against live HTTP servers on
127.0.0.1 and 127.0.0.2 (loopback both; the setting allows the second). The real
`swift deploy` server's refusals are in tests/test_swift_inference.py."""

from __future__ import annotations

import http.server
import ipaddress
import re
import socket
import threading
import time

import pytest

from swift_safe_media import MediaDecodeError, config
from swift_safe_media.hosts.swift import url_policy

ALLOW = config.SERVE_ALLOW_HOSTS
REFUSED_BY_DEFAULT = "internal addresses are refused when serving (SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS)"


# --- live media servers -------------------------------------------------------------------

def media_server(host: str, body: bytes = b"", redirect: str | None = None):
    """An HTTP server on ``host`` that serves ``body`` at any path, or redirects every GET
    to ``redirect`` (302): (server, its base URL, the requests it received as (path, Host))."""
    seen = []

    class Media(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Host")))
            self.send_response(302 if redirect else 200)
            if redirect:
                self.send_header("Location", redirect)
            self.send_header("Content-Length", str(0 if redirect else len(body)))
            self.end_headers()
            if not redirect:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Counting(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def process_request(self, request, client_address):
            seen.append(("<connection>", None))
            super().process_request(request, client_address)

    server = Counting((host, 0), Media)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}", seen


def no_connection(seen: list) -> bool:
    time.sleep(0.3)  # a connection made would have been accepted by now
    return not seen


# --- the classifier -----------------------------------------------------------------------

@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "a loopback address"), ("127.255.0.9", "a loopback address"), ("::1", "a loopback address"),
    ("0.0.0.0", "an unspecified address"), ("0.1.2.3", "an unspecified address"), ("::", "an unspecified address"),
    ("10.1.2.3", "a private address"), ("172.16.0.1", "a private address"), ("172.31.255.255", "a private address"),
    ("192.168.0.1", "a private address"), ("fd00::1", "a private address"), ("fc00::1", "a private address"),
    ("fec0::1", "a private address"), ("64:ff9b:1::a", "a private address"),
    ("100.64.0.1", "a carrier-grade NAT address"), ("100.127.255.254", "a carrier-grade NAT address"),
    ("169.254.1.1", "a link-local address"), ("fe80::1", "a link-local address"),
    ("169.254.169.254", "a link-local address (a cloud metadata endpoint)"),
    ("fd00:ec2::254", "a private address (a cloud metadata endpoint)"),
    ("100.100.100.200", "a carrier-grade NAT address (a cloud metadata endpoint)"),
    ("224.0.0.1", "a multicast address"), ("239.255.255.250", "a multicast address"), ("ff02::1", "a multicast address"),
    ("240.0.0.1", "a reserved address"), ("255.255.255.255", "a reserved address"),
    ("192.0.2.1", "a reserved address"), ("198.18.0.1", "a reserved address"), ("::7f00:1", "a reserved address"),
    ("::ffff:127.0.0.1", "a loopback address (the IPv4-mapped form of 127.0.0.1)"),
    ("::ffff:10.0.0.1", "a private address (the IPv4-mapped form of 10.0.0.1)"),
    ("::ffff:169.254.169.254",
     "a link-local address (the IPv4-mapped form of 169.254.169.254, a cloud metadata endpoint)"),
    ("2002:7f00:1::", "a loopback address (the 6to4 form of 127.0.0.1)"),
    ("2002:c0a8:101::1", "a private address (the 6to4 form of 192.168.1.1)"),
    ("64:ff9b::a00:1", "a private address (the NAT64 form of 10.0.0.1)"),
])
def test_internal_addresses_are_named_by_kind(address, kind):
    assert url_policy.internal_kind(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "100.63.255.255", "100.128.0.1", "172.32.0.1",
                                     "2001:4860:4860::8888", "::ffff:8.8.8.8", "2002:808:808::", "64:ff9b::808:808"])
def test_public_addresses_pass(address):
    assert url_policy.internal_kind(ipaddress.ip_address(address)) is None


# --- URLs as the resolver reads them ----------------------------------------------------------

@pytest.mark.parametrize("url, resolved, kind", [
    ("http://127.0.0.1:9/clip.mp4", "127.0.0.1", "a loopback address"),
    ("http://2130706433/clip.mp4", "127.0.0.1", "a loopback address"),  # decimal
    ("http://0177.0.0.1/clip.mp4", "127.0.0.1", "a loopback address"),  # octal
    ("http://0x7f.1/clip.mp4", "127.0.0.1", "a loopback address"),  # hex, two parts
    ("http://localhost./clip.mp4", "127.0.0.1", "a loopback address"),
    ("http://0.0.0.0:8000/", "0.0.0.0", "an unspecified address"),
    ("http://[::1]:8000/clip.mp4", "::1", "a loopback address"),
    ("HTTPS://[::ffff:127.0.0.1]/a.png", "::ffff:7f00:1", "a loopback address (the IPv4-mapped form of 127.0.0.1)"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254", "a link-local address (a cloud metadata endpoint)"),
])
def test_a_url_is_judged_by_what_its_host_resolves_to(url, resolved, kind):
    with pytest.raises(MediaDecodeError) as refused:
        url_policy.check(url)
    assert refused.value.path == url
    assert refused.value.reason.startswith(f"resolves to {ipaddress.ip_address(resolved)}, {kind}; ")


def test_every_address_a_name_resolves_to_is_checked(monkeypatch):
    """A name with a public and an internal address is refused (the connection may take
    either); one whose addresses are all public passes, and the hop connects only to them."""
    answers = {"mixed.example": ["8.8.8.8", "10.0.0.7"], "public.example": ["8.8.8.8", "2001:4860:4860::8888"]}
    monkeypatch.setattr(url_policy.socket, "getaddrinfo", lambda host, *args, **kwargs: [
        (socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))
        for address in answers[host]])
    with pytest.raises(MediaDecodeError, match="resolves to 10.0.0.7, a private address; "):
        url_policy.check("https://mixed.example/clip.mp4")
    assert url_policy.check("https://public.example/clip.mp4") == \
        url_policy.Checked(("8.8.8.8", "2001:4860:4860::8888"), internal=False)


def test_a_host_that_does_not_resolve_or_a_url_without_one_is_refused():
    with pytest.raises(MediaDecodeError, match="names the host 'nothing.invalid', which does not resolve"):
        url_policy.check("http://nothing.invalid/clip.mp4")
    with pytest.raises(MediaDecodeError, match="redirected to file:///etc/passwd, which is not an http"):
        url_policy.check("file:///etc/passwd", "http://8.8.8.8/clip.mp4")
    with pytest.raises(MediaDecodeError, match=r"^http://\[::1/clip.mp4: it is not a valid URL \(Invalid IPv6 URL\)"):
        url_policy.check("http://[::1/clip.mp4")


# --- the setting ----------------------------------------------------------------------------

def test_the_setting_names_hosts_addresses_and_networks(monkeypatch):
    monkeypatch.setenv(ALLOW, " Media.Internal. , 127.0.0.2, [::1], 10.0.0.0/8, fd00::/8,192.168.1.7/24")
    allowed = url_policy.allowed()
    assert allowed.names == {"media.internal"}
    assert [str(network) for network in allowed.networks] == \
        ["127.0.0.2/32", "::1/128", "10.0.0.0/8", "fd00::/8", "192.168.1.0/24"]
    for entry in ("10.0.0.0/33", "media.internal:8080", "::1/200"):
        monkeypatch.setenv(ALLOW, entry)
        with pytest.raises(ValueError, match=f"^{ALLOW}=.*is not a host name, an IP address or a CIDR network"):
            url_policy.allowed()


def test_what_the_setting_names_passes_and_nothing_else(monkeypatch):
    monkeypatch.setenv(ALLOW, "127.0.0.2,localhost,10.0.0.0/8,169.254.169.254")
    assert url_policy.check("http://127.0.0.2:8000/clip.mp4") == url_policy.Checked(("127.0.0.2",), internal=True)
    assert url_policy.check("http://localhost/clip.mp4").internal  # by name, whatever it resolves to
    assert url_policy.check("http://10.9.8.7/clip.mp4").internal
    assert url_policy.check("http://[::ffff:10.9.8.7]/clip.mp4").internal  # the network holds its IPv4 form
    assert url_policy.check("http://8.8.8.8/clip.mp4") == url_policy.Checked(("8.8.8.8",), internal=False)
    for url, kind in (("http://127.0.0.1/clip.mp4", "a loopback address"),  # localhost's address, by another name
                      ("http://2130706433/clip.mp4", "a loopback address"),
                      ("http://192.168.0.1/clip.mp4", "a private address")):
        with pytest.raises(MediaDecodeError, match=re.escape(f"{kind}; {REFUSED_BY_DEFAULT}")):
            url_policy.check(url)
    with pytest.raises(MediaDecodeError, match="cloud metadata endpoints are refused when serving, listed or not"):
        url_policy.check("http://169.254.169.254/latest/meta-data/")
    monkeypatch.setenv(ALLOW, "0.0.0.0/0,::/0")  # everything: still not the metadata endpoints
    assert url_policy.check("http://127.0.0.1/clip.mp4").internal
    with pytest.raises(MediaDecodeError, match="a cloud metadata endpoint"):
        url_policy.check("http://[fd00:ec2::254]/")


# --- the download, hop by hop, against live servers -------------------------------------------

@pytest.fixture
def serving_downloads(monkeypatch):
    """ms-swift's own fetcher, its internal-address switches unset, our setting allowing
    127.0.0.2 only; the engine's timeout roomy (its sandboxes start here)."""
    from swift.utils.url_utils import SafeUrlFetcher

    for name in ("SWIFT_ALLOW_INTERNAL_URL", "SWIFT_URL_ALLOWED_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ALLOW, "127.0.0.2")
    monkeypatch.setenv(config.TIMEOUT, "60")
    return SafeUrlFetcher


def test_a_redirect_into_the_internal_network_is_refused_at_its_hop(serving_downloads):
    """An allowed host (127.0.0.2) redirects to one that is not (127.0.0.1): the request's
    URL is refused, naming the hop, and the internal server sees no connection; a redirect
    that stays on the allowed host is followed (ms-swift's own check, which refuses every
    non-public address by default, does not refuse it again)."""
    from swift_safe_media.hosts.swift import serving

    internal, internal_url, reached = media_server("127.0.0.1", b"secret")
    bouncer, bouncer_url, bounced = media_server("127.0.0.2", redirect=f"{internal_url}/clip.mp4")
    media, media_url, _ = media_server("127.0.0.2", b"clip bytes")
    hop, hop_url, _ = media_server("127.0.0.2", redirect=f"{media_url}/clip.mp4")
    try:
        with pytest.raises(MediaDecodeError) as refused:
            serving._download(serving_downloads, f"{bouncer_url}/clip.mp4", 10)
        assert refused.value.path == f"{bouncer_url}/clip.mp4"
        assert refused.value.reason == (f"redirected to {internal_url}/clip.mp4, which resolves to 127.0.0.1, "
                                        f"a loopback address; {REFUSED_BY_DEFAULT}")
        assert [path for path, _ in bounced] == ["<connection>", "/clip.mp4"] and no_connection(reached)
        body, left, timeout = serving._download(serving_downloads, f"{hop_url}/start", 10)
        assert body == b"clip bytes" and 0 < left <= timeout == 60
    finally:
        for server in (internal, bouncer, media, hop):
            server.shutdown()


def test_the_download_connects_to_the_addresses_checked():
    """A hop's download does not resolve its host again: it connects to the addresses its
    check found (here a name that resolves nowhere, pinned to a live server), and the host
    still names the request."""
    from swift_safe_media.hosts.swift import serving

    media, media_url, seen = media_server("127.0.0.2", b"pinned")
    port = media.server_address[1]
    try:
        kind, body = serving._get_one_hop(f"http://media.invalid:{port}/clip.mp4", 10, 0, ("127.0.0.3", "127.0.0.2"))
    finally:
        media.shutdown()
    assert (kind, body) == ("body", b"pinned")  # 127.0.0.3 (nothing listens) tried first, then the next
    assert ("/clip.mp4", f"media.invalid:{port}") in seen


def test_a_pinned_https_download_still_checks_the_certificate_against_the_host(tmp_path, monkeypatch):
    """Over TLS the pinned connection sends the URL's host as its server name and checks the
    certificate against it: a certificate for media.test is accepted for https://media.test
    (which resolves nowhere) pinned to 127.0.0.2, and refused for another name."""
    import shutil
    import ssl
    import subprocess
    import urllib.error

    from swift_safe_media.hosts.swift import serving

    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=media.test",
                    "-addext", "subjectAltName=DNS:media.test", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the only authority the client trusts
    media, _, seen = media_server("127.0.0.2", b"over tls")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    media.socket = context.wrap_socket(media.socket, server_side=True)
    port = media.server_address[1]
    try:
        assert serving._get_one_hop(f"https://media.test:{port}/clip.mp4", 10, 0, ("127.0.0.2",)) == \
            ("body", b"over tls")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED|certificate"):
            serving._get_one_hop(f"https://other.test:{port}/clip.mp4", 10, 0, ("127.0.0.2",))
    finally:
        media.shutdown()
    assert ("/clip.mp4", f"media.test:{port}") in seen


def test_a_proxied_url_is_left_to_its_proxy(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    monkeypatch.setenv("no_proxy", "direct.example")
    assert url_policy.pinned_handlers("http://media.example/clip.mp4", ("8.8.8.8",)) == []
    assert len(url_policy.pinned_handlers("http://direct.example/clip.mp4", ("8.8.8.8",))) == 2
    assert len(url_policy.pinned_handlers("https://media.example/clip.mp4", ("8.8.8.8",))) == 2  # no https_proxy
