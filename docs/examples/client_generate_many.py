import asyncio

from producer import StreamqClient


async def main() -> None:
    prompts = [f"Write a haiku about the number {i}." for i in range(100)]
    async with StreamqClient.connect() as client:
        requests = [{"prompt": prompt, "request_id": f"haiku-{i}"} for i, prompt in enumerate(prompts)]
        async for completion in client.generate_many(requests, max_tokens=32):  # as each one ends
            print(completion.request_id, completion.finish_reasons, completion.completion_tokens)


asyncio.run(main())
