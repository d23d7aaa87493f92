import asyncio

from producer import StreamqClient


async def main() -> None:
    async with StreamqClient.connect() as client:
        handle = await client.submit("The key to happiness is", max_tokens=32, temperature=0)
        async for text in handle.text():  # the text as it comes
            print(text, end="", flush=True)
        print()
        completion = await handle.result()  # after iterating: what was streamed, as a whole
        print(completion.finish_reason, completion.usage.prompt_tokens, completion.usage.completion_tokens)

        chat = await client.submit(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32)
        try:
            reply = await chat.result(timeout=30)  # or collect everything at once
        except TimeoutError:  # the request keeps running: stop it
            await chat.cancel()
            raise
        print(reply.text)


asyncio.run(main())
