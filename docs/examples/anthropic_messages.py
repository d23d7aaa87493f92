from anthropic import Anthropic

client = Anthropic()  # $ANTHROPIC_BASE_URL (the gateway, no /v1) and $ANTHROPIC_API_KEY
model = client.models.list().data[0].id
message = client.messages.create(
    model=model, max_tokens=32, system="Answer briefly.", messages=[{"role": "user", "content": "Hi!"}]
)
print("".join(block.text for block in message.content if block.type == "text"))
print(message.stop_reason, message.usage.input_tokens, message.usage.output_tokens)

with client.messages.stream(model=model, max_tokens=32, messages=[{"role": "user", "content": "Hi!"}]) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
print(stream.get_final_message().stop_reason)
