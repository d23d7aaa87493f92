import asyncio

from producer import StreamqClient


async def main() -> None:
    async with StreamqClient.connect() as client:
        completion = await client.generate(
            "The key to happiness is", max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=1
        )
        assert completion.logprobs is not None and completion.prompt_logprobs is not None  # asked for
        for token in completion.logprobs[0]:  # one TokenLogprob per token of completion.token_ids[0]
            print(repr(token.token), token.logprob, token.rank, [(t.token, t.logprob) for t in token.top])
        print(completion.prompt_logprobs[1:3])  # one per prompt token; None for the first


asyncio.run(main())
