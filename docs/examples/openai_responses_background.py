import time

from openai import OpenAI

client = OpenAI()  # $OPENAI_BASE_URL and $OPENAI_API_KEY
model = client.models.list().data[0].id
job = client.responses.create(model=model, input="Write a haiku.", max_output_tokens=32, background=True)
while job.status in ("queued", "in_progress"):  # any gateway answers: the job is in Redis
    time.sleep(0.5)
    job = client.responses.retrieve(job.id)
print(job.status, repr(job.output_text))
# Its events again, after the first one a client had (sequence number 0):
for event in client.responses.retrieve(job.id, stream=True, starting_after=0):
    print(event.sequence_number, event.type)
follow_up = client.responses.create(model=model, previous_response_id=job.id, input="Another.", max_output_tokens=32)
print(follow_up.status, repr(follow_up.output_text))
