from openai import OpenAI

schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
client = OpenAI()  # $OPENAI_BASE_URL and $OPENAI_API_KEY
model = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Who is it?"}],
    max_tokens=200,
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
)
print(reply.choices[0].message.content, reply.choices[0].finish_reason)  # JSON once finish_reason is "stop"
code = client.completions.create(
    model=model, prompt="Code:", max_tokens=16, extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}}
)
print(code.choices[0].text)
