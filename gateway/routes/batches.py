"""OpenAI's Batch API routes: ``POST /v1/batches``, ``GET /v1/batches``,
``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``, answering
``openai.types.Batch`` objects field for field.

A batch created here is a record in Redis in state ``validating``
(``gateway.batch_api.records``); a runner (any gateway's) validates its input file and
runs it. Batches and their files belong to the API key's name, or to one namespace on a
gateway without keys: another key's batch is a 404 and never in its lists.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import TENANT_STATE, Tenant
from gateway.batch_api.objects import BatchRecord, FileRecord
from gateway.batch_api.records import BatchStore, batch_not_found
from gateway.request_status import error_response
from gateway.routes.completions import json_body, queue_tenant_of
from gateway.routes.files import file_not_found, list_page, owner_of
from gateway.state import services_of
from producer.openai_api.endpoints import CHAT_COMPLETIONS, COMPLETIONS, POOLING_BATCH_PATHS
from producer.openai_api.errors import ApiError, bad_request

BATCHES_PATH: Final = "/v1/batches"
BATCH_ENDPOINTS: Final = (CHAT_COMPLETIONS.path, COMPLETIONS.path, *POOLING_BATCH_PATHS)
"""What a batch's lines may call: the gateway's endpoints that answer one request a line."""
CREATE_FIELDS: Final = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
MAX_METADATA_PAIRS: Final = 16
MAX_METADATA_KEY: Final = 64
MAX_METADATA_VALUE: Final = 512
MIN_EXPIRY_S: Final = 3600
MAX_EXPIRY_S: Final = 30 * 24 * 3600
"""``output_expires_after.seconds``: one hour to 30 days, as OpenAI takes it."""
DEFAULT_LIST_LIMIT: Final = 20
MAX_LIST_LIMIT: Final = 100

router = APIRouter()


@router.post(BATCHES_PATH)
async def create_batch(request: Request) -> Response:
    try:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return JSONResponse((await _create(request, body)).to_openai())
    except Exception as exc:
        return error_response(exc)


@router.get(BATCHES_PATH)
async def list_batches(request: Request) -> Response:
    try:
        after = request.query_params.get("after")
        limit = _limit(request.query_params.get("limit"))
        records, more = await _store(request).list(owner_of(request), after=after, limit=limit)
        return JSONResponse(list_page([record.to_openai() for record in records], more))
    except Exception as exc:
        return error_response(exc)


@router.get(BATCHES_PATH + "/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> Response:
    try:
        record = await _store(request).get(batch_id, owner_of(request))
        if record is None:
            raise batch_not_found(batch_id)
        return JSONResponse(record.to_openai())
    except Exception as exc:
        return error_response(exc)


@router.post(BATCHES_PATH + "/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    try:
        record = await _store(request).request_cancel(batch_id, owner_of(request))
        return JSONResponse(record.to_openai())
    except Exception as exc:
        return error_response(exc)


def _store(request: Request) -> BatchStore:
    return services_of(request.app).batch_api.batches


async def _create(request: Request, body: dict[str, Any]) -> BatchRecord:
    """The batch ``body`` asks for, checked as OpenAI checks it and stored ``validating``."""
    config = services_of(request.app).batch_api.config
    unknown = sorted(set(body) - CREATE_FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    endpoint = _required_string(body, "endpoint")
    if endpoint not in BATCH_ENDPOINTS:
        raise _invalid_value("endpoint", endpoint, BATCH_ENDPOINTS)
    window = _required_string(body, "completion_window")
    if window not in config.completion_windows:
        raise _invalid_value("completion_window", window, sorted(config.completion_windows))
    metadata = _metadata(body.get("metadata"))
    output_expiry_s = _output_expiry_s(body.get("output_expires_after"), config.output_expiry_s)
    owner = owner_of(request)
    input_file = await _input_file(request, _required_string(body, "input_file_id"), owner)
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    created_at = int(time.time())
    record = BatchRecord(
        id=f"batch_{uuid.uuid4().hex}",
        owner=owner,
        queue_tenant=queue_tenant_of(request, tenant) or "",
        key_digest=tenant.digest if tenant is not None and tenant.record is not None else "",
        endpoint=endpoint,
        input_file_id=input_file.id,
        completion_window=window,
        created_at=created_at,
        expires_at=created_at + config.completion_windows[window],
        priority=config.batch_priority,
        online_reserve=config.online_reserve,
        output_expires_after_s=output_expiry_s,
        metadata=json.dumps(metadata) if metadata is not None else "",
        total=input_file.lines,
    )
    await _store(request).create(record)
    return record


async def _input_file(request: Request, file_id: str, owner: str) -> FileRecord:
    """The owner's file ``file_id``, which must hold a batch's input (purpose ``batch``)."""
    record = await services_of(request.app).batch_api.files.get(file_id, owner)
    if record is None:
        error = file_not_found(file_id)
        error.param = "input_file_id"
        raise error
    if record.purpose != "batch":
        message = f"file {file_id} has purpose {record.purpose!r}: a batch reads a file uploaded with purpose 'batch'"
        raise bad_request(message, param="input_file_id", code="invalid_value")
    return record


def _required_string(body: dict[str, Any], name: str) -> str:
    if name not in body or body[name] is None:
        raise bad_request(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    value = body[name]
    if not isinstance(value, str):
        raise _invalid_type(name, "a string", value)
    return value


def _metadata(value: Any) -> dict[str, str] | None:
    """At most 16 pairs of strings, keys of at most 64 characters and values of at most 512,
    as OpenAI's ``metadata`` everywhere."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid_type("metadata", "an object", value)
    if len(value) > MAX_METADATA_PAIRS:
        message = (
            f"Invalid 'metadata': too many properties. Expected an object with at most {MAX_METADATA_PAIRS} "
            f"properties, but got an object with {len(value)} properties instead."
        )
        raise bad_request(message, param="metadata", code="object_above_max_properties")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise _too_long("metadata", MAX_METADATA_KEY, key)
        if not isinstance(item, str):
            raise _invalid_type(f"metadata.{key}", "a string", item)
        if len(item) > MAX_METADATA_VALUE:
            raise _too_long(f"metadata.{key}", MAX_METADATA_VALUE, item)
    return value


def _output_expiry_s(value: Any, default_s: int) -> int:
    """``output_expires_after``: ``{"anchor": "created_at", "seconds": 3600..2592000}``."""
    if value is None:
        return default_s
    if not isinstance(value, dict):
        raise _invalid_type("output_expires_after", "an object", value)
    unknown = sorted(set(value) - {"anchor", "seconds"})
    if unknown:
        param = f"output_expires_after.{unknown[0]}"
        raise bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if value.get("anchor") != "created_at":
        raise _invalid_value("output_expires_after.anchor", value.get("anchor"), ["created_at"])
    seconds = value.get("seconds")
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise _invalid_type("output_expires_after.seconds", "an integer", seconds)
    if not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
        message = (
            f"Invalid 'output_expires_after.seconds': expected a value from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}, "
            f"but got {seconds} instead."
        )
        raise bad_request(message, param="output_expires_after.seconds", code="invalid_value")
    return seconds


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIST_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        raise bad_request(f"Invalid 'limit': expected an integer, but got {raw!r} instead.", param="limit") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        message = f"Invalid 'limit': expected a value from 1 to {MAX_LIST_LIMIT}, but got {limit} instead."
        raise bad_request(message, param="limit", code="invalid_value")
    return limit


def _invalid_value(param: str, value: Any, supported: Any) -> ApiError:
    choices = ", ".join(repr(choice) for choice in supported)
    message = f"Invalid value: {value!r}. Supported values are: {choices}."
    return bad_request(message, param=param, code="invalid_value")


_JSON_TYPES: Final = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer"}


def _invalid_type(param: str, expected: str, value: Any) -> ApiError:
    got = "null" if value is None else _JSON_TYPES.get(type(value), "a number")
    message = f"Invalid type for '{param}': expected {expected}, but got {got} instead."
    return bad_request(message, param=param, code="invalid_type")


def _too_long(param: str, bound: int, value: str) -> ApiError:
    message = (
        f"Invalid '{param}': string too long. Expected a string with maximum length {bound}, "
        f"but got a string with length {len(value)} instead."
    )
    return bad_request(message, param=param, code="string_above_max_length")
