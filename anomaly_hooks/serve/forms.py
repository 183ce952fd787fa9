"""Multipart bodies read within bounds: the files and fields of an upload request.

Starlette's parser keeps every text field in memory (up to 1 MiB each, up to ``max_fields`` of
them) and every file's first MiB; a client that sends many large text fields and then stalls
holds that memory for as long as it stalls. :func:`read_form` parses with the service's
bounds instead, each refused the moment it is exceeded, before the rest of the body is read:

* a text field (``part_id``, ``source``) holds at most :data:`FIELD_MAX_BYTES` (413);
* at most ``max_fields`` text fields and ``max_files`` files (413);
* a file holds at most ``max_file_bytes`` (the upload limit; 413);
* each file keeps at most :data:`SPOOL_BYTES` in memory, the rest in a temporary file;
* a part's headers (name, file name, type) take at most :data:`PART_HEAD_MAX_BYTES` (400).

So one request holds at most ``max_files * SPOOL_BYTES + max_fields * FIELD_MAX_BYTES`` in
memory while its body arrives; the routes admit a request before reading its body and read it
under the request timeout, which bounds how many do and for how long.
"""
from __future__ import annotations

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from anomaly_hooks.serve.errors import ServeError, client_gone

FIELD_MAX_BYTES = 2048          # part_id (200 characters), source (500): UTF-8 fits
SPOOL_BYTES = 64 * 1024         # of each file in memory; the rest on disk
PART_HEAD_MAX_BYTES = 8 * 1024  # Content-Disposition and Content-Type of one part


class BoundedMultiPartParser(MultiPartParser):
    """Starlette's multipart parser with the bounds above, raising the service's errors.

    It follows Starlette's parser (its ``_current_part`` is the part being read), whose
    callbacks run while each chunk of the body is fed in."""

    spool_max_size = max_file_size = SPOOL_BYTES  # the name of each Starlette version

    def __init__(self, request: Request, *, max_files: int, max_fields: int,
                 max_file_bytes: int) -> None:
        inf = float("inf")  # the limits are checked here, with the service's codes
        super().__init__(request.headers, request.stream(), max_files=inf, max_fields=inf)
        self.limits = (max_files, max_fields, max_file_bytes)
        self.files = self.fields = 0
        self._part_bytes = self._head_bytes = 0

    def on_part_begin(self) -> None:
        super().on_part_begin()
        self._part_bytes = self._head_bytes = 0

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_head(end - start)
        super().on_header_field(data, start, end)

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_head(end - start)
        super().on_header_value(data, start, end)

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        max_files, max_fields, _ = self.limits
        if self._current_part.file is not None:
            self.files += 1
            if self.files > max_files:
                raise _refused(413, "too_many_images", f"more than {max_files} files in one "
                               "request (a batch takes the server's --max-batch-files)")
        else:
            self.fields += 1
            if self.fields > max_fields:
                raise _refused(413, "payload_too_large", f"more than {max_fields} form "
                               "fields in one request")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._part_bytes += end - start
        if self._current_part.file is not None:
            if self._part_bytes > self.limits[2]:
                raise _refused(413, "payload_too_large", f"a file of more than "
                               f"{self.limits[2]:,} bytes (the server's --max-upload-mb)")
        elif self._part_bytes > FIELD_MAX_BYTES:
            raise _refused(413, "payload_too_large", f"a form field of more than "
                           f"{FIELD_MAX_BYTES:,} bytes (part_id and source are short texts)")
        super().on_part_data(data, start, end)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > PART_HEAD_MAX_BYTES:
            raise _refused(400, "malformed_request", f"the headers of a multipart part take "
                           f"more than {PART_HEAD_MAX_BYTES:,} bytes")


def _refused(status: int, code: str, message: str) -> ServeError:
    """A refusal while the body may still be arriving: the connection is closed after the
    answer, rather than read to the end of a body that is not wanted."""
    return ServeError(status, code, message, {"Connection": "close"})


async def read_form(request: Request, *, max_files: int, max_fields: int,
                    max_file_bytes: int) -> FormData:
    """The multipart form of ``request`` within the bounds above (400 for a broken body or a
    client that went away mid-body; 413 past a bound). The caller closes it."""
    parser = BoundedMultiPartParser(request, max_files=max_files, max_fields=max_fields,
                                    max_file_bytes=max_file_bytes)
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise _refused(400, "malformed_request", f"broken multipart body: {exc.message}"
                     ) from None
    except ClientDisconnect:
        raise client_gone() from None

