"""``swift deploy``: a request whose media fail gets its own HTTP 400, naming the file,
within the timeout; the server keeps serving the others.

- ``SwiftDeploy.create_error_response``: the 400 body also names the file, the reason
  and the error's type.
- ``SwiftDeploy.create_chat_completion``: the request's media URLs are downloaded before
  ms-swift's handler runs, on threads, so the event loop goes on serving the other
  requests meanwhile (ms-swift downloads them in the event loop itself: a server that
  trickles its bytes would hold every request); a streamed request's first chunk is taken
  before the response begins, so a failed decode is a 400, not a cut stream.
- ``SafeUrlFetcher.read``: ms-swift's download, whose timeout is per network operation,
  runs hop by hop in an unconfined sandbox within ``--safe_media_timeout``, each hop
  checked first against internal addresses (:mod:`.url_policy`: refused with the request's
  400 unless ``SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS`` allows it; connected to the addresses
  checked), then by ms-swift's own ``check_url`` (the URLs downloaded beforehand are handed over).
- ``SwiftDeploy._materialize_media``: the file ms-swift writes the download to is noted
  with what the download left of the timeout (:func:`..decoders.inputs.note_download`),
  so the download and the decode together get one timeout, as a URL does in training.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import sys
import threading
import time

from ... import config
from ...records import summary
from ...errors import MediaDecodeError
from . import url_policy
from .inference import MODE, describe, media_failure

log = logging.getLogger("swift_safe_media")

# --- the HTTP error names the file -------------------------------------------------------


def error_naming_media(stock, status_code, message):
    """``SwiftDeploy.create_error_response``: called by ms-swift's handlers as they catch a
    request's exception. When that is a failed decode, the JSON body also carries the file,
    the reason and the error's type."""
    response = stock(status_code, message)
    failure = media_failure(sys.exc_info()[1])
    return response if failure is None else _error_naming(failure, message, response.status_code)


def _error_naming(failure: MediaDecodeError, message: str, status_code: int):
    from fastapi.responses import JSONResponse

    summary.note_failed_row()
    return JSONResponse({"message": message, "object": "error", **describe(failure)}, status_code)


# --- a request: its URLs downloaded off the event loop, its stream begun after its media ----

# The media URLs of the request being handled, downloaded already: url -> (body, seconds of
# the timeout left) or the exception. Set for the handler's task only (a context variable).
_DOWNLOADED_FOR_REQUEST: contextvars.ContextVar[dict] = contextvars.ContextVar("swift_safe_media_downloaded", default={})


async def serve_chat_completion(stock, deploy, request, raw_request, **kwargs):
    """``SwiftDeploy.create_chat_completion`` while serving: the request's media URLs are
    downloaded first, on threads (once ms-swift's own checks of the request, its API key
    included, pass); then ms-swift's handler; a streamed response's first chunk is taken
    before the response goes out, so a request whose media fail gets its 400 like any other."""
    if MODE.name != "deploy":
        return await stock(deploy, request, raw_request, **kwargs)
    urls = await _urls_to_download(deploy, request, raw_request)
    outcomes = await asyncio.gather(*(asyncio.to_thread(_outcome, url) for url in urls))
    token = _DOWNLOADED_FOR_REQUEST.set(dict(zip(urls, outcomes)))
    try:
        response = await stock(deploy, request, raw_request, **kwargs)
    finally:
        _DOWNLOADED_FOR_REQUEST.reset(token)
    return await _first_chunk_taken(response)


async def _urls_to_download(deploy, request, raw_request) -> list[str]:
    """The media URLs ms-swift's handler would download (as it spells them), none where its
    checks refuse the request first (then ms-swift answers it, downloading nothing)."""
    try:
        refused = (await deploy._check_model(request) or deploy._check_api_key(raw_request)
                   or deploy._check_max_logprobs(request))
        if refused:
            return []
        values = [getattr(request, f"{kind}s", None) or [] for kind in ("image", "audio", "video")]
        for message in request.messages:
            content = message.get("content") if isinstance(message, dict) else None
            for item in content if isinstance(content, list) else ():
                key = item.get("type", "") if isinstance(item, dict) else ""
                if key.removesuffix("_url") in ("image", "audio", "video") and key in item:
                    values.append(item[key])
        return list(dict.fromkeys(_urls_in(values)))
    except Exception:  # fail-open: ms-swift downloads them itself (bounded, in the loop)
        return []


def _urls_in(value):
    """The http(s) URLs in a media value as ``SwiftDeploy._materialize_media`` reads it."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _urls_in(item)
    elif isinstance(value, dict):
        yield from _urls_in(value.get("url", value.get("bytes") or value.get("path")))
    elif isinstance(value, str):
        match = re.match(r"(https?)://", value.strip(), re.IGNORECASE)
        if match:
            yield match.group(1).lower() + value.strip()[len(match.group(1)):]


def _outcome(url: str):
    from swift.utils.url_utils import SafeUrlFetcher

    from ...decoders.inputs import url_timeout

    try:
        return _download(SafeUrlFetcher, url, url_timeout())
    except Exception as exc:  # raised where ms-swift's handler reads the URL
        return exc


async def _first_chunk_taken(response):
    chunks = getattr(response, "body_iterator", None)
    if chunks is None:
        return response
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except Exception as exc:
        failure = media_failure(exc)
        if failure is None:
            first = exc  # not ours: the stream fails as stock's does
        else:
            return _error_naming(failure, str(failure), 400)
    response.body_iterator = _resumed(first, chunks)
    return response


async def _resumed(first, chunks):
    if isinstance(first, Exception):
        raise first
    if first is not None:
        yield first
        async for chunk in chunks:
            yield chunk


# --- a request's media URL: download and decode within one timeout ----------------------------

_REDIRECTS = (301, 302, 303, 307, 308)
# The last download ms-swift's handler read on this thread: (url, seconds left, timeout),
# for SwiftDeploy._materialize_media, which writes it to a file, to note.
_LAST_READ = threading.local()


def read_url_within_timeout(stock, fetcher, url, **kwargs):
    """``SafeUrlFetcher.read`` while serving: the download the request's handler made
    beforehand, or one made now (:func:`_download`)."""
    from ...engine.calls import in_sandbox

    if MODE.name != "deploy" or in_sandbox():
        return stock(url, **kwargs)
    outcome = _DOWNLOADED_FOR_REQUEST.get().get(url)
    if outcome is None:
        outcome = _download(fetcher, url, kwargs.get("timeout"))
    if isinstance(outcome, BaseException):
        raise outcome
    body, left, timeout = outcome
    _LAST_READ.value = (url, left, timeout)
    return body


def file_named_with_its_download(stock, value, media_type, temp_dir):
    """``SwiftDeploy._materialize_media``: the file a media URL is written to is noted with
    what its download left of the timeout (its decode gets that, and names the URL)."""
    _LAST_READ.value = None
    materialized = stock(value, media_type, temp_dir)
    read, _LAST_READ.value = getattr(_LAST_READ, "value", None), None
    if read is not None and isinstance(materialized, str) and MODE.name == "deploy":
        from ...decoders.inputs import note_download

        url, left, timeout = read
        note_download(materialized, url, left, timeout)
    return materialized


def _download(fetcher, url: str, per_operation):
    """ms-swift's download (redirects followed one at a time, its size cap), every hop
    checked (:func:`_check_hop`) and fetched in an unconfined sandbox, all within one
    timeout (``--safe_media_timeout``): (body, seconds of the timeout left, the timeout). A
    download that overruns it raises MediaDecodeTimeout (the request's HTTP 400)."""
    from urllib.parse import urljoin

    from ...engine.calls import fetch

    requested = url
    timeout, max_size, deadline = config.timeout(), fetcher._max_download_size(), None
    for _ in range(fetcher.MAX_REDIRECTS + 1):
        addresses = _check_hop(fetcher, url, requested)
        left = timeout if deadline is None else deadline - time.monotonic()
        (kind, value), hop_deadline, _ = fetch(_get_one_hop, url, per_operation, max_size, addresses,
                                               path=url, timeout=left)
        deadline = deadline or hop_deadline
        if kind == "body":
            return value, deadline - time.monotonic(), timeout
        url = urljoin(url, value)
    raise ValueError(f"The URL {url!r} exceeded the limit of {fetcher.MAX_REDIRECTS} redirects.")


def _check_hop(fetcher, url: str, requested: str) -> tuple[str, ...]:
    """One hop of the request's URL ``requested``: our check of its addresses
    (:func:`.url_policy.check`: a refusal is the request's 400, named in the log), then
    ms-swift's ``check_url`` (its schemes, metadata endpoints, ``SWIFT_URL_ALLOWED_HOSTS``),
    which does not refuse again, as not public, an internal address our setting allowed.
    The addresses the hop's download may connect to."""
    try:
        checked = url_policy.check(url, requested)
    except MediaDecodeError as refused:
        log.warning(f"swift_safe_media: refused {refused.path}: {refused.reason}; its request is answered with HTTP 400")
        raise
    if checked.internal and callable(getattr(fetcher, "_allow_internal_url", None)):
        fetcher = type(fetcher.__name__, (fetcher,), {"_allow_internal_url": staticmethod(lambda: True)})
    fetcher.check_url(url)
    return checked.addresses


def _get_one_hop(url: str, per_operation, max_size: int, addresses=()):
    """In the sandbox: GET ``url`` without following a redirect, connecting only to
    ``addresses`` (the hop's checked ones; :func:`.url_policy.pinned_handlers`):
    ("redirect", location), or ("body", bytes) capped at ``max_size`` (0: no cap), as
    ``SafeUrlFetcher`` caps it."""
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect, *url_policy.pinned_handlers(url, addresses))
    try:
        response = opener.open(url, timeout=per_operation)
    except urllib.error.HTTPError as error:
        if error.code in _REDIRECTS and error.headers.get("location"):
            return "redirect", error.headers["location"]
        raise ValueError(f"{error.code} {error.reason} for url: {url}") from None
    with response:
        body = response.read(max_size + 1) if max_size > 0 else response.read()
    if max_size > 0 and len(body) > max_size:
        raise ValueError(f"Refusing to fetch {url!r}: the response is larger than {max_size / 1024 ** 2:.0f}MB. "
                         "Raise or disable this cap with the environment variable `SWIFT_MAX_DOWNLOAD_SIZE_MB`.")
    return "body", body
