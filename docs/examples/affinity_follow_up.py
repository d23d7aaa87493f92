import asyncio

from producer import StreamqClient

INSTRUCTIONS = "You are a patient tutor. Answer in short sentences, one idea each. " * 8


async def main() -> None:
    async with StreamqClient.connect() as client:
        messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "What is a prime?"}]
        first = await client.generate(messages=messages, max_tokens=24)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Name three."}]
        follow_up = await client.generate(messages=messages, max_tokens=24)  # held for first.worker_id
        print(first.worker_id, follow_up.worker_id, follow_up.worker_id == first.worker_id)


asyncio.run(main())
