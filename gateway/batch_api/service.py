"""The Batch API's parts, built and started with the gateway: the files' storage and records,
the batches' records, and the runner that moves this gateway's share of the batches on."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.auth import ApiKeyAuth
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.files import FileStore
from gateway.batch_api.records import BatchStore
from gateway.batch_api.runner import BatchRunner
from gateway.batch_api.storage import Storage
from gateway.key_limits import KeyLimiter
from producer.internal_client import InternalClient
from producer.openai_api.limits import RequestLimits


@dataclass
class BatchApi:
    config: BatchApiConfig
    files: FileStore
    batches: BatchStore
    runner: BatchRunner

    @classmethod
    def build(
        cls,
        client: InternalClient,
        auth: ApiKeyAuth,
        limiter: KeyLimiter,
        config: BatchApiConfig,
        limits: RequestLimits,
    ) -> BatchApi:
        storage = Storage.from_url(config.files_url, config.s3_options)
        files = FileStore(client.redis, storage, config)
        batches = BatchStore(client.redis, config)
        runner = BatchRunner(client, files, batches, auth, limiter, config, limits)
        return cls(config, files, batches, runner)

    async def start(self) -> None:
        self.files.start()
        if self.config.run_batches:
            self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        await self.files.stop()
