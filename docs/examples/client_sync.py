from concurrent.futures import ThreadPoolExecutor

from producer.sync import StreamqClient

with StreamqClient.connect() as client:  # blocking: no event loop; $REDIS_URL and $STREAMQ_QUEUE
    print(client.generate("The key to happiness is", max_tokens=32).text)

    with client.submit("Once upon a time", max_tokens=32) as handle:
        for text in handle.text():  # a plain for
            print(text, end="", flush=True)
    print()

    # One client serves every thread of a web server, a Celery worker, a script's pool.
    with ThreadPoolExecutor(8) as threads:
        prompts = [f"Name a colour number {i}:" for i in range(8)]
        for completion in threads.map(lambda prompt: client.generate(prompt, max_tokens=8), prompts):
            print(completion.request_id, completion.finish_reason, completion.usage.completion_tokens)
