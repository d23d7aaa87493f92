"""OpenAI's completions API on the producer side, shared by the gateway and the batch runner.

``requests``: bodies to ``StreamqClient.submit`` arguments; ``responses``: whole
responses; ``chunks``: streamed chunks; ``errors``: failures to HTTP statuses and error
bodies; ``endpoints``: the two URLs and what each maps through. No web framework is imported.
"""
