import asyncio

from producer import ChunkEvent, StreamqClient


async def main() -> None:
    async with await StreamqClient.connect() as client:
        handle = await client.submit("The key to happiness is", max_tokens=32, temperature=0)
        async for event in handle:  # chunk events, then final (or error)
            if isinstance(event, ChunkEvent):
                print(event.text, end="", flush=True)
        print()

        chat = await client.submit(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32)
        try:
            completion = await chat.result(timeout=30)  # or collect everything at once
        except TimeoutError:  # the request keeps running: stop it
            await chat.cancel()
            raise
        print(completion.text)
        print(completion.finish_reasons, completion.prompt_tokens, completion.completion_tokens)


asyncio.run(main())
