"""The gateway's live dashboard: its HTTP API (``routes``), the snapshot it serves
(``snapshot``), built from workers' reports by one sampler per gateway process
(``sampler``), with rates and percentiles over a window (``history``, ``percentiles``).
The page itself is static files under ``static/``."""
