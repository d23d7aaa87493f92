from openai import OpenAI

client = OpenAI()  # $OPENAI_BASE_URL and $OPENAI_API_KEY
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=32, stream=True
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
