from openai import OpenAI

client = OpenAI()  # $OPENAI_BASE_URL and $OPENAI_API_KEY
model = client.models.list().data[0].id
out = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2, max_tokens=4
)
logprobs = out.choices[0].logprobs
assert logprobs is not None and logprobs.content is not None  # asked for
print([(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in logprobs.content])
