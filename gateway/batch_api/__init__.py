"""OpenAI's Files and Batch APIs at the gateway (``/v1/files``, ``/v1/batches``).

A file's bytes live in a storage (``storage``: a local directory, or an S3-compatible store),
its record in Redis (``files``). A batch is a durable record in Redis (``records``) whose lines
run through the queue as any request does; any gateway process runs batches, each one owned
by one gateway at a time under a lease (``runner``), so a gateway that dies hands its batches
to another, which goes on where it stopped.
"""
