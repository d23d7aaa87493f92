from collections.abc import Iterator

from flask import Flask, Response, request

from producer import RequestError
from producer.sync import StreamqClient

app = Flask(__name__)
client = StreamqClient.connect()  # one client for every thread of the server: $REDIS_URL, $STREAMQ_QUEUE


@app.post("/complete")
def complete() -> dict[str, str]:
    completion = client.generate(request.get_data(as_text=True), max_tokens=32)
    return {"text": completion.text, "finish_reason": completion.finish_reason or ""}


@app.post("/stream")
def stream() -> Response:
    handle = client.submit(request.get_data(as_text=True), max_tokens=32, cancel_on_close=True)

    def tokens() -> Iterator[str]:
        with handle:  # a client that goes away closes the response: the request is cancelled
            try:
                yield from handle.text()
            except RequestError as error:
                yield f"\n[error: {error.code}]"

    return Response(tokens(), mimetype="text/plain")
