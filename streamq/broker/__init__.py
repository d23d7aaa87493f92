"""The Redis side both producers and workers use: connections, pub/sub, the replay log,
the worker registry."""
