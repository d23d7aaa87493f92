import json
import time

from openai import OpenAI

client = OpenAI()  # $OPENAI_BASE_URL (the gateway: http://localhost:8000/v1) and $OPENAI_API_KEY
model = client.models.list().data[0].id  # a model with a live worker

# One request a line, each with a custom_id of your own: the output is matched to it by that.
questions = ["What is Redis?", "Name a prime number.", "Say hello in French."]
lines = [
    {
        "custom_id": f"question-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 16},
    }
    for i, q in enumerate(questions)
]
jsonl = "".join(json.dumps(line) + "\n" for line in lines).encode()
batch_input = client.files.create(file=("questions.jsonl", jsonl), purpose="batch")

batch = client.batches.create(
    input_file_id=batch_input.id,
    endpoint="/v1/chat/completions",
    completion_window="24h",
    metadata={"job": "docs-example"},
)
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(1)
    batch = client.batches.retrieve(batch.id)

counts = batch.request_counts
print(batch.status, f"{counts.completed}/{counts.total}" if counts else "")
if batch.output_file_id:  # lines come in the order they finished: sort them by custom_id
    results = [json.loads(raw) for raw in client.files.content(batch.output_file_id).text.splitlines()]
    for result in sorted(results, key=lambda r: r["custom_id"]):
        print(result["custom_id"], result["response"]["body"]["choices"][0]["message"]["content"])
if batch.error_file_id:  # lines that failed: their status code and OpenAI's error body
    print(client.files.content(batch.error_file_id).text)
