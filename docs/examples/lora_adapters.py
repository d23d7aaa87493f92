import asyncio

from producer import StreamqClient


async def main() -> None:
    async with StreamqClient.connect() as client:
        print(sorted(await client.live_models()))  # the base model and each adapter, on one queue
        for model in ("sql", "poet", "sql"):
            completion = await client.generate("Describe the sea.", model=model, max_tokens=16)
            print(model, completion.worker_id)  # an adapter's requests find the worker that ran it last


asyncio.run(main())
