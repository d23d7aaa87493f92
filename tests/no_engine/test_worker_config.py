"""The worker's configuration (``worker/config.py``): one frozen ``WorkerConfig`` built once
where the worker starts, from its flags (whose defaults are the environment's, a flag given
winning) or, under plain ``arq worker.WorkerSettings``, from the environment alone; arq's
settings made from it; nothing read from the environment at import."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from streamq.env_vars import (
    ALLOW_EVICTING_ENV,
    CALLBACK_SECRET_ENV,
    CHECKPOINT_TOKENS_ENV,
    COALESCE_ENV,
    CPU_NICE_ENV,
    DRAIN_SECONDS_ENV,
    DURABLE_ENDS_ENV,
    ENGINE_ARGS_ENV,
    ENGINE_FACTORY_ENV,
    KEEP_RESULT_ENV,
    LOG_MAXLEN_ENV,
    LOG_TTL_ENV,
    METRICS_PORT_ENV,
    QUEUE_ENV,
    REDIS_URL_ENV,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    import worker
    from worker.config import WorkerConfig, config_from_env, config_of
    from worker.settings import WorkerSettings, arq_settings
    from worker.startup import config_from_args, parse_args

FACTORY = "devkit.scripted_engine:create"

ENVIRONMENT = {
    REDIS_URL_ENV: "redis://redis.example:6380",
    QUEUE_ENV: "streamq:queue:from-env",
    DRAIN_SECONDS_ENV: "7",
    KEEP_RESULT_ENV: "90",
    METRICS_PORT_ENV: "0",
    CPU_NICE_ENV: "3",
    ALLOW_EVICTING_ENV: "1",
    LOG_TTL_ENV: "5",
    LOG_MAXLEN_ENV: "11",
    COALESCE_ENV: "0",
    CHECKPOINT_TOKENS_ENV: "8",
    DURABLE_ENDS_ENV: "off",
    CALLBACK_SECRET_ENV: "hush",
    ENGINE_FACTORY_ENV: FACTORY,
}
FROM_ENVIRONMENT = WorkerConfig(
    redis_url="redis://redis.example:6380",
    queue="streamq:queue:from-env",
    drain_seconds=7,
    keep_result_s=90.0,
    metrics_port=0,
    cpu_nice=3,
    allow_evicting_redis=True,
    log_ttl_ms=5000,
    log_maxlen=11,
    coalesce=False,
    checkpoint_tokens=8,
    durable_ends="off",
    callback_secret="hush",
    engine_factory=FACTORY,
)


def test_the_environment_alone_gives_each_variables_value() -> None:
    assert config_from_env(ENVIRONMENT) == FROM_ENVIRONMENT


def test_an_empty_environment_gives_the_built_in_defaults() -> None:
    assert config_from_env({ENGINE_FACTORY_ENV: FACTORY}) == WorkerConfig(engine_factory=FACTORY)


def test_a_bad_value_is_refused_naming_its_variable() -> None:
    with pytest.raises(ValueError, match=r"\$STREAMQ_KEEP_RESULT_S must be >= 0"):
        config_from_env({ENGINE_FACTORY_ENV: FACTORY, KEEP_RESULT_ENV: "-1"})


def test_the_flags_default_to_the_environment_and_a_flag_given_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_ARGS_ENV, raising=False)
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    assert config_from_args(parse_args([])) == FROM_ENVIRONMENT
    given = config_from_args(parse_args(["--queue", "streamq:queue:flag", "--metrics-port", "9999", "--max-jobs", "4"]))
    assert given == dataclasses.replace(FROM_ENVIRONMENT, queue="streamq:queue:flag", metrics_port=9999, max_jobs=4)


def test_arqs_settings_come_from_the_config_which_they_carry() -> None:
    config = WorkerConfig(
        redis_url="redis://redis.example:6380", queue="q", drain_seconds=3, keep_result_s=9, engine_factory=FACTORY
    )
    settings = arq_settings(config)
    assert settings["queue_name"] == "q"
    assert (settings["redis_settings"].host, settings["redis_settings"].port) == ("redis.example", 6380)
    assert (settings["job_completion_wait"], settings["keep_result"]) == (3, 9)
    assert settings["max_jobs"] == WorkerSettings.max_jobs  # raised to the engine's once it is up
    assert config_of(settings["ctx"]) is config
    assert arq_settings(dataclasses.replace(config, max_jobs=4))["max_jobs"] == 4


def test_nothing_is_read_from_the_environment_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    env_dependent = {"queue_name", "redis_settings", "job_completion_wait", "keep_result", "ctx"}
    assert not env_dependent & set(vars(WorkerSettings))
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    settings = worker.WorkerSettings  # what `arq worker.WorkerSettings` runs: read when asked for
    assert config_of(settings["ctx"]) == FROM_ENVIRONMENT
    assert settings["queue_name"] == "streamq:queue:from-env"


def test_a_ctx_without_a_config_is_refused() -> None:
    with pytest.raises(RuntimeError, match="holds no WorkerConfig"):
        config_of({})


@pytest.mark.parametrize(("name", "value"), [(COALESCE_ENV, "of"), (LOG_MAXLEN_ENV, "0")])
def test_a_variable_the_worker_cannot_read_stops_it_as_a_bad_flag_does(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        parse_args(["--engine-factory", FACTORY])
    assert exited.value.code == 2
    assert f"python -m worker: error: ${name}" in capsys.readouterr().err
