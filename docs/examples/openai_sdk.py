from openai import OpenAI

client = OpenAI()  # $OPENAI_BASE_URL (the gateway: http://localhost:8000/v1) and $OPENAI_API_KEY
model = client.models.list().data[0].id  # a model with a live worker
reply = client.completions.create(model=model, prompt="The key to happiness is", max_tokens=32)
print(reply.choices[0].text)
