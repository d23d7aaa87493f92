"""OpenAI's Files API: ``POST /v1/files`` (a streamed upload), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.

Files belong to the API key's tenant (``owner_of``): another key's files answer 404 and are
not listed. Only ``purpose=batch`` is taken: the files batches write are ``batch_output``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.auth import TENANT_STATE, Tenant
from gateway.batch_api import names
from gateway.batch_api.files import FileInUse, FileStore, FileTooLarge, StoredBytes
from gateway.batch_api.form import MAX_FORM_OVERHEAD, FormPart, MalformedForm, StreamedForm, form_boundary
from gateway.batch_api.objects import FilePurpose, FileRecord
from gateway.state import services_of
from producer.openai_api.errors import ApiError, ApiErrorType, api_error_for, bad_request

router = APIRouter()

UPLOAD_PURPOSES: Final = ("batch",)
"""What an upload may be for; ``batch_output`` is only for the files batches write."""
LIST_PURPOSES: Final = ("batch", "batch_output")
MIN_EXPIRY_S: Final = 3600
MAX_EXPIRY_S: Final = 30 * 24 * 3600
"""OpenAI's bounds on ``expires_after[seconds]``: an hour to 30 days."""
MAX_LIST_LIMIT: Final = 10_000
MAX_FILENAME_CHARS: Final = 1024
EXPIRY_FIELDS: Final = ("expires_after[anchor]", "expires_after[seconds]")


def owner_of(request: Request) -> str:
    """The namespace of the request's files and batches: its API key's name, or the one
    open namespace on a gateway without keys."""
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    return names.OPEN_NAMESPACE if tenant is None else tenant.name


def file_not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", type=ApiErrorType.NOT_FOUND, param="file_id")


def _error(exc: BaseException) -> JSONResponse:
    if isinstance(exc, FileTooLarge | FileInUse):
        error = exc.api_error()
    elif isinstance(exc, MalformedForm):
        error = bad_request(f"the multipart form could not be read: {exc}", param="file")
    else:
        error = api_error_for(exc)
    headers = dict(error.headers or {})
    if isinstance(exc, FileTooLarge):
        headers["connection"] = "close"  # the rest of the body is never read
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


def _files(request: Request) -> FileStore:
    return services_of(request.app).batch_api.files


@router.post("/v1/files")
async def create_file(request: Request) -> Response:
    """Upload a file: the form's ``file`` streams to the storage as it arrives (413 once it
    passes the limit, at once for a body declared longer), ``purpose`` and ``expires_after``
    are checked as soon as they are read, before or after the file."""
    try:
        return JSONResponse((await _upload(request)).to_openai())
    except Exception as exc:
        return _error(exc)


async def _upload(request: Request) -> FileRecord:
    files = _files(request)
    limit = files.config.max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + MAX_FORM_OVERHEAD:
        raise FileTooLarge(limit)
    form = StreamedForm(request.stream(), form_boundary(request.headers.get("content-type")))
    owner = owner_of(request)
    fields: dict[str, str] = {}
    stored: StoredBytes | None = None
    filename = "file"
    try:
        async for part in form.parts():
            if part.name != "file":
                fields[part.name] = await part.text()
                continue
            if stored is not None:
                raise bad_request("the form has more than one `file`", param="file")
            _check_fields(fields, complete=False)  # what came before the file: refused unread
            filename = _filename(part)
            stored = await files.store(owner, part.data())
        if stored is None:
            raise bad_request("the form has no `file`", param="file")
        purpose, expires_after_s = _check_fields(fields, complete=True)
        return await files.record(stored, filename, purpose, expires_after_s)
    except BaseException:
        if stored is not None:
            await files.discard(stored)
        raise


def _filename(part: FormPart) -> str:
    filename = part.filename or "file"
    if len(filename) > MAX_FILENAME_CHARS:
        raise bad_request(f"the file's name is longer than {MAX_FILENAME_CHARS} characters", param="file")
    return filename


def _check_fields(fields: dict[str, str], *, complete: bool) -> tuple[FilePurpose, int | None]:
    """``purpose`` and ``expires_after`` as OpenAI checks them (those not read yet pass
    unless the form is ``complete``)."""
    purpose = fields.get("purpose")
    if purpose is None and complete:
        raise bad_request("the form has no `purpose` (it must be 'batch')", param="purpose")
    if purpose is not None and purpose not in UPLOAD_PURPOSES:
        raise bad_request(
            f"purpose {purpose!r} is not served here: uploads are for batches (purpose 'batch')", param="purpose"
        )
    anchor, seconds = (fields.get(name) for name in EXPIRY_FIELDS)
    if anchor is None and seconds is None:
        return "batch", None
    if anchor is None or seconds is None:
        if not complete:
            return "batch", None
        missing = EXPIRY_FIELDS[0] if anchor is None else EXPIRY_FIELDS[1]
        raise bad_request(f"expires_after needs both anchor and seconds; {missing} is missing", param=missing)
    if anchor != "created_at":
        raise bad_request(f"expires_after[anchor] must be 'created_at', not {anchor!r}", param=EXPIRY_FIELDS[0])
    if not seconds.isdigit() or not MIN_EXPIRY_S <= int(seconds) <= MAX_EXPIRY_S:
        raise bad_request(
            f"expires_after[seconds] must be a whole number from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}, not {seconds!r}",
            param=EXPIRY_FIELDS[1],
        )
    return "batch", int(seconds)


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    """The tenant's files, newest first unless ``order=asc``; ``after`` and ``limit`` page
    through them (``has_more`` ends the SDK's iteration)."""
    try:
        query = request.query_params
        limit = _whole(query.get("limit"), "limit", default=MAX_LIST_LIMIT, low=1, high=MAX_LIST_LIMIT)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', not {order!r}", param="order")
        purpose = query.get("purpose")
        if purpose is not None and purpose not in LIST_PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(LIST_PURPOSES)}, not {purpose!r}", param="purpose")
        records, more = await _files(request).list(
            owner_of(request), after=query.get("after"), limit=limit, order=order, purpose=purpose
        )
        return JSONResponse(list_page([record.to_openai() for record in records], more))
    except Exception as exc:
        return _error(exc)


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of a list as OpenAI answers one (the SDK's cursor pages read ``has_more``)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _whole(raw: str | None, param: str, *, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise bad_request(f"{param} must be a whole number from {low} to {high}, not {raw!r}", param=param)
    return int(raw)


async def _owned(request: Request, file_id: str) -> FileRecord:
    record = await _files(request).get(file_id, owner_of(request))
    if record is None:
        raise file_not_found(file_id)
    return record


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> Response:
    try:
        return JSONResponse((await _owned(request, file_id)).to_openai())
    except Exception as exc:
        return _error(exc)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    """The file's bytes, streamed a chunk at a time."""
    try:
        record = await _owned(request, file_id)
        chunks = _files(request).content(record)
        try:
            first = await anext(chunks, b"")
        except FileNotFoundError:
            raise file_not_found(file_id) from None  # its bytes are gone (deleted meanwhile)
    except Exception as exc:
        return _error(exc)

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    headers = {"content-length": str(record.bytes), "content-disposition": _attachment(record.filename)}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


def _attachment(filename: str) -> str:
    ascii_name = filename.encode("ascii", "replace").decode().replace('"', "'")
    return f'attachment; filename="{ascii_name}"'


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    """Delete the file; refused (400, ``file_in_use``) while a batch that has not finished
    reads it."""
    try:
        if not await _files(request).delete(file_id, owner_of(request)):
            raise file_not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
    except Exception as exc:
        return _error(exc)
