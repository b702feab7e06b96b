"""A request body over the server's limit gets 413 before anything parses it, while /health
and other clients keep being served."""

from __future__ import annotations

import threading

import httpx

_WAIT_S = 120


def test_oversized_body_gets_413_while_health_answers(server):
    limit = 2 << 20
    declared = httpx.post(server.url + "/v1/completions", content=b"x" * (5 << 20),
                          headers={"Content-Type": "application/json"}, timeout=_WAIT_S)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"

    # a chunked upload with no Content-Length, sent slowly: refused once past the limit,
    # and /health answers while it is still coming in
    chunk = 64 << 10
    uploading = threading.Event()
    result: list[httpx.Response] = []

    def slow_body():
        for i in range((5 << 20) // chunk):
            if i == 4:
                uploading.set()
            yield b"x" * chunk
            threading.Event().wait(0.02)

    def upload() -> None:
        try:
            result.append(httpx.post(server.url + "/v1/completions", content=slow_body(),
                                     timeout=_WAIT_S))
        except httpx.TransportError as exc:  # the server may close before the body ends
            result.append(exc)

    uploader = threading.Thread(target=upload)
    uploader.start()
    assert uploading.wait(_WAIT_S)
    assert httpx.get(server.url + "/health", timeout=_WAIT_S).status_code == 200
    uploader.join(_WAIT_S)
    response, = result
    if isinstance(response, httpx.Response):
        assert response.status_code == 413

    # just under the limit: parsed and tokenized (off the event loop), then refused as too
    # long for the model, which is a 400
    words = " hello" * ((limit - 100) // 6)
    under = httpx.post(server.url + "/v1/completions", json={"prompt": words},
                       timeout=_WAIT_S)
    assert under.status_code == 400
    assert under.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health", timeout=_WAIT_S).status_code == 200
