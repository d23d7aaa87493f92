"""streamq's benchmarks: the queue path beside the bare engine and ``vllm serve``.

``python -m bench`` runs everything; see ``bench/README.md``. Benchmarks, not tests:
they report figures and never fail on them.
"""
