"""Every failure maps to the HTTP status and OpenAI error body that the table in docs/gateway.md documents."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.errors import (
    DuplicateRequest,
    InvalidParameter,
    MissingEvents,
    NoLiveWorker,
    QueueFull,
    RequestError,
    RequestLost,
    StreamqError,
    UnknownModel,
)
from producer.openai_api.errors import ApiError, api_error_for, bad_request
from streamq.protocol import ErrorCode, InvalidRequest

CLIENT_FAILURES: list[tuple[BaseException, int, str, str]] = [
    (InvalidRequest("prompt must be a string"), 400, "invalid_request_error", "invalid_parameter"),
    (UnknownModel("no worker serves model 'x'"), 404, "not_found_error", "model_not_found"),
    (DuplicateRequest("request r1 exists"), 409, "invalid_request_error", "duplicate_request"),
    (QueueFull("queue holds 8 jobs"), 429, "rate_limit_error", "queue_full"),
    (NoLiveWorker("every worker of 'x' is gone"), 503, "service_unavailable_error", "no_live_worker"),
    (RedisConnectionError("refused"), 503, "service_unavailable_error", "redis_unavailable"),
    (RedisTimeoutError("slow"), 503, "service_unavailable_error", "redis_unavailable"),
    (ConnectionError("reset"), 503, "service_unavailable_error", "redis_unavailable"),
    (TimeoutError("ping"), 503, "service_unavailable_error", "redis_unavailable"),
    (MissingEvents("events 4..6 missing"), 500, "internal_error", "internal"),
    (StreamqError("something else"), 500, "internal_error", "internal"),
    (RuntimeError("a bug"), 500, "internal_error", "internal"),
]


@pytest.mark.parametrize(("exc", "status", "kind", "code"), CLIENT_FAILURES, ids=lambda v: type(v).__name__)
def test_client_failures_map_to_their_status(exc: BaseException, status: int, kind: str, code: str) -> None:
    error = api_error_for(exc)
    assert (error.status, error.body()["error"]["type"], error.body()["error"]["code"]) == (status, kind, code)
    assert str(exc) in error.message


def test_model_errors_name_the_model_parameter() -> None:
    assert api_error_for(UnknownModel("x")).param == "model"
    assert api_error_for(NoLiveWorker("x")).param == "model"


def test_a_refused_parameter_is_named() -> None:
    error = api_error_for(InvalidParameter("n=17 is over the limit of 16 completions per request", param="n"))
    assert (error.status, error.param, error.code) == (400, "n", "invalid_parameter")
    assert api_error_for(InvalidRequest("prompt must be a string")).param is None


def test_a_full_queue_says_when_to_retry() -> None:
    assert api_error_for(QueueFull("full")).headers == {"Retry-After": "1"}
    assert api_error_for(UnknownModel("x")).headers is None


def test_the_error_body_has_openais_four_fields() -> None:
    body = bad_request("max_tokens must be an int", param="max_tokens").body()
    assert body == {
        "error": {
            "message": "max_tokens must be an int",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_parameter",
        }
    }


def test_an_api_error_maps_to_itself() -> None:
    error = ApiError(404, "no request 'r1' to resume", code="request_not_found")
    assert api_error_for(error) is error


def test_parameters_the_worker_refuses_are_a_400_with_the_workers_message() -> None:
    error = api_error_for(RequestError("r1", ErrorCode.INVALID_REQUEST, "temperature must be >= 0"))
    assert (error.status, error.code, error.message) == (400, "invalid_parameter", "temperature must be >= 0")


@pytest.mark.parametrize("code", [c for c in ErrorCode if c is not ErrorCode.INVALID_REQUEST])
def test_every_other_worker_error_code_is_a_500_that_keeps_the_code(code: ErrorCode) -> None:
    body = api_error_for(RequestError("r1", code, "went wrong")).body()["error"]
    assert api_error_for(RequestError("r1", code, "went wrong")).status == 500
    assert body == {"message": f"{code}: went wrong", "type": "internal_error", "param": None, "code": code}


def test_a_lost_request_is_a_500_with_its_code() -> None:
    error = api_error_for(RequestLost("r1", "lost", "neither queued nor running"))
    assert (error.status, error.code) == (500, "lost")
