import asyncio

from producer import StreamqClient


async def main() -> None:
    async with StreamqClient.connect() as client:  # $REDIS_URL and $STREAMQ_QUEUE, or the defaults
        completion = await client.generate("The key to happiness is", max_tokens=32)
        print(completion.text)


asyncio.run(main())
