from openai import OpenAI

client = OpenAI()  # $OPENAI_BASE_URL and $OPENAI_API_KEY
model = client.models.list().data[0].id
response = client.responses.create(
    model=model, instructions="Answer briefly.", input="The key to happiness is", max_output_tokens=16
)
print(response.id, response.status, repr(response.output_text))
with client.responses.stream(model=model, input="In a galaxy far", max_output_tokens=16) as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
    final = stream.get_final_response()
print()
print(final.status, final.usage.output_tokens if final.usage else None)
