"""``make demo``: three prompts through the queue, end to end.

A throwaway Redis (unless ``$REDIS_URL`` is set), one worker, then ``python -m producer``
printing each response token by token. The model is ``$STREAMQ_DEMO_MODEL``; where the hub
cannot be reached and it is not cached, a tiny local model with random weights stands in,
over a vocabulary of English words so that its random tokens print as words.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from devkit.redis_server import RedisServer
from devkit.tiny_model import WORDS_DIR, build_tiny_model
from devkit.worker_process import WorkerProcess, tiny_engine_flags, worker_env
from streamq.env_vars import DEMO_MODEL_ENV, REDIS_URL_ENV
from streamq.redaction import redact_url

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DASHBOARD_URL = "http://127.0.0.1:8000/dashboard"
"""Where ``make dashboard`` serves the dashboard (unless port 8000 is taken)."""
PROMPTS = [
    "The future of artificial intelligence is",
    "In a galaxy far, far away",
    "The key to happiness is",
]


def hub_model_available(model: str) -> bool:
    """True if ``model`` is a local directory, is cached, or the hub answers for it."""
    if Path(model).is_dir():
        return True
    try:
        from huggingface_hub import HfApi, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return True
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            return False
        HfApi().model_info(model, timeout=5)
        return True
    except Exception:
        return False


def choose_engine_flags(say: str = "demo") -> tuple[list[str], dict[str, str]]:
    """Engine flags and environment for the demo's worker (``say`` prefixes what it prints)."""
    model = os.environ.get(DEMO_MODEL_ENV, DEFAULT_MODEL)
    if hub_model_available(model):
        print(f"{say}: model {model}", flush=True)
        return ["--model", model, "--max-model-len", "2048", "--enforce-eager"], worker_env(HF_HUB_OFFLINE="0")
    print(
        f"{say}: the Hugging Face hub is not reachable and {model} is not cached;\n"
        f"{say}: using a tiny local model with random weights instead (its words are random, the pipeline is real)",
        flush=True,
    )
    return tiny_engine_flags(build_tiny_model(WORDS_DIR, vocabulary="words")), worker_env()


def run_demo(redis_url: str) -> int:
    flags, env = choose_engine_flags()
    log_path = Path(".cache/demo-worker.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    worker = WorkerProcess(redis_url, flags, log_path=log_path, env=env)
    print(f"demo: starting a worker (log: {log_path}) ...", flush=True)
    try:
        worker.start().wait_ready()
        print("demo: worker ready; streaming the three prompts through Redis\n", flush=True)
        producer = [sys.executable, "-m", "producer", "--redis-url", redis_url, "--max-tokens", "48", *PROMPTS]
        status = subprocess.run(producer).returncode
    finally:
        code = worker.stop()
        print(f"\ndemo: worker stopped (exit code {code})", flush=True)
    print(f"demo: see it live: make dashboard (opens {DASHBOARD_URL})", flush=True)
    return status


def redis_url_or_throwaway(stack: contextlib.ExitStack, say: str) -> str:
    """``$REDIS_URL``, else the URL of a throwaway Redis that ``stack`` stops (``say``
    prefixes what it prints)."""
    redis_url = os.environ.get(REDIS_URL_ENV)
    if not redis_url:
        redis_url = stack.enter_context(RedisServer()).url
        print(f"{say}: started a throwaway Redis at {redact_url(redis_url)}", flush=True)
    return redis_url


def main() -> int:
    with contextlib.ExitStack() as stack:
        return run_demo(redis_url_or_throwaway(stack, say="demo"))


if __name__ == "__main__":
    sys.exit(main())
