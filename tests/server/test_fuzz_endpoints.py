"""The hypothesis HTTP fuzz of test_fuzz_api.py, extended to every endpoint (issue 29):
/tokenize and /detokenize bodies, the GET routes with junk query strings and headers, and
every route under methods it does not take. Whatever comes, the answer is never a 5xx: a
documented status with an OpenAI error body, or a real answer; and the server keeps serving.
"""

from __future__ import annotations


import httpx
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.entrypoints.server.protocol import DetokenizeRequest, TokenizeRequest
from tests.server.test_fuzz_api import (BIG_INTS, CONTENT_TYPES, FUZZ, JSON, MESSAGE, TEXT,
                                        WORDS, _fuzz, bodies)

POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
         "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]
GETS = ["/v1/models", "/health", "/metrics", "/openapi.json"]
PATHS = POSTS + GETS

TOKENIZE = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "gpt-9"]) | TEXT | JSON,
    "prompt": WORDS | JSON, "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "add_special_tokens": st.booleans() | JSON, "add_generation_prompt": st.booleans() | JSON})
DETOKENIZE = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["SmolLM2-135M-Instruct"]) | TEXT | JSON,
    "tokens": st.lists(st.integers(0, 49151) | BIG_INTS, max_size=6) | JSON})
# header values: printable ASCII without surrounding blanks (what an HTTP client can send at
# all: h11 refuses a value that starts or ends with whitespace before it leaves the client)
HEADER_VALUES = st.text(st.characters(min_codepoint=32, max_codepoint=126),
                        max_size=20).map(str.strip)
HEADERS = st.dictionaries(st.sampled_from(["accept", "x-junk", "authorization", "cookie",
                                           "accept-encoding", "range", "if-none-match"]),
                          HEADER_VALUES, max_size=3)
# query text: no lone surrogates, which a client cannot encode as UTF-8 to send at all
QUERY_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
QUERIES = st.dictionaries(QUERY_TEXT.filter(bool), QUERY_TEXT, max_size=3)


def _has_json(response: httpx.Response) -> None:
    assert response.json()


def _post(server, path: str, body: bytes, content_type: str | None, model: type) -> None:
    _fuzz(server, path, body, content_type, model, check_answer=_has_json)


@FUZZ
@given(body=bodies(TOKENIZE), content_type=CONTENT_TYPES)
def test_fuzz_tokenize(server, body, content_type):
    _post(server, "/tokenize", body, content_type, TokenizeRequest)


@FUZZ
@given(body=bodies(DETOKENIZE), content_type=CONTENT_TYPES)
def test_fuzz_detokenize(server, body, content_type):
    _post(server, "/detokenize", body, content_type, DetokenizeRequest)


@FUZZ
@given(path=st.sampled_from(GETS), params=QUERIES, headers=HEADERS)
def test_fuzz_get_routes(server, path, params, headers):
    response = httpx.get(server.url + path, params=params, headers=headers, timeout=60)
    assert response.status_code == 200, response.text  # nothing here depends on the input


@FUZZ
@given(path=st.sampled_from(PATHS),
       method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST", "OPTIONS"]),
       body=st.binary(max_size=30))
def test_fuzz_methods(server, path, method, body):
    response = httpx.request(method, server.url + path, content=body, timeout=60)
    assert response.status_code < 500, response.text
    allowed = "POST" if path in POSTS else "GET"
    if method != allowed:
        assert response.status_code == 405
        error = response.json()["error"]
        if path.startswith("/v1/messages"):  # Anthropic's shape there
            assert set(error) == {"type", "message"}, error
        else:
            assert set(error) == {"message", "type", "param", "code"}, error


def test_still_serves_after_fuzzing_every_endpoint(server):
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hello"},
                      timeout=60).json()["count"] > 0
    response = httpx.post(server.url + "/v1/completions",
                          json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
    assert response.status_code == 200
    m = server.wait_idle()
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
