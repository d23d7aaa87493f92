import asyncio

from producer import ChunkEvent, StreamqClient


async def main() -> None:
    async with StreamqClient.connect() as client:
        async with await client.submit("Tell me a long story", max_tokens=1000, cancel_on_close=True) as handle:
            async for event in handle:
                if isinstance(event, ChunkEvent):
                    print(event.text, end="", flush=True)
                    if event.seq == 4:
                        break  # leaving the block cancels the request, and its worker frees the slot
        print()


asyncio.run(main())
