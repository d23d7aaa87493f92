import asyncio

from producer import StreamqClient, StructuredOutputs

schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def main() -> None:
    async with StreamqClient.connect() as client:
        person = await client.generate("Who is it?", max_tokens=200, structured_outputs=StructuredOutputs(json=schema))
        answer = await client.generate("Is it?", structured_outputs={"choice": ["yes", "no"]})
        print(person.text, person.finish_reasons)  # valid JSON once the finish reason is "stop"
        print(answer.text)


asyncio.run(main())
