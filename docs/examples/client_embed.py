import asyncio
import os

from producer import StreamqClient

MODEL = os.environ.get("STREAMQ_EMBED_MODEL", "my-embedder")  # its workers' --served-model-name


async def main() -> None:
    async with StreamqClient.connect() as client:
        documents = ["Redis keeps the queue.", "vLLM runs the model.", "Workers pull jobs."]
        embedded = await client.embed(documents, model=MODEL)  # one request, one job
        query = (await client.embed("Where do jobs wait?", model=MODEL)).as_lists()[0]
        # The vectors are normalized (the model's default): their dot product is the cosine.
        scores = [sum(a * b for a, b in zip(vector, query, strict=True)) for vector in embedded.as_lists()]
        best = max(range(len(documents)), key=scores.__getitem__)
        print(documents[best])
        print(len(query), "dimensions;", embedded.prompt_tokens, "tokens per document")


asyncio.run(main())
