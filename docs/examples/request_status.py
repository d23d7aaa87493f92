import asyncio

from producer import StreamqClient


async def main() -> None:
    async with StreamqClient.connect() as client:
        handle = await client.submit("The key to happiness is", max_tokens=16)
        print((await client.status(handle.request_id)).state)  # queued or running, most likely
        await handle.result(timeout=30)
        status = await client.status(handle.request_id)  # a RequestStatus (msgspec Struct)
        print(status.state, status.finish_reasons, status.completion_tokens)


asyncio.run(main())
