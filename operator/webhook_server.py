"""One admission webhook endpoint for a replica's whole life, across its kopf runs.

A standby answers the admission webhooks in a kopf run of the admission handlers alone; when
it takes the Lease over, that run stops and the replica's main kopf run begins. Were each run
to serve its own endpoint, the port would be closed from the first's stop until the second
listens (connection refused: with ``failurePolicy: Fail`` the API server refuses the Pods
created then, and the Pod stays Ready meanwhile). ``SharedWebhookServer`` is what both runs
get as ``settings.admission.server``: one kopf ``WebhookServer`` that begins listening when
the first run asks for it and stops when the replica does, and answers each review with the
handlers of the run that asked last (one that stopped answers until the next asks).

It listens in a thread and event loop of its own: as a kopf run stops, it cancels every task
started in its event loop since it began, and the task of a connection the API server keeps
open would be one. Each review is answered in the operator's loop, in a task of its own, in
the context (kopf's context variables) of the run whose handlers answer it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import kopf

logger = logging.getLogger(__name__)

# How long the replica's stop waits for the endpoint to close (reviews under way finish first).
CLOSE_TIMEOUT_S = 15.0


class SharedWebhookServer:
    """A kopf admission server (``settings.admission.server``) that outlives the kopf runs."""

    def __init__(self, server: kopf.WebhookServer) -> None:
        self._server = server
        self._handlers: tuple[kopf.WebhookFn, asyncio.AbstractEventLoop, contextvars.Context] | None = None
        self._config: kopf.WebhookClientConfig | None = None
        self._version = 0  # how many client configs the server has yielded
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        """What kopf calls in each run: from now on ``fn`` answers; yields the client configs."""
        loop = asyncio.get_running_loop()
        self._handlers = (fn, loop, contextvars.copy_context())
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, args=(loop,), name="kvpool-webhook", daemon=True
            )
            self._thread.start()
        seen = 0
        while True:
            while self._version == seen:
                if self._error is not None:
                    raise self._error
                await self._changed.wait()
            seen = self._version
            assert self._config is not None
            yield self._config

    async def close(self) -> None:
        """Stop listening (once reviews under way are answered)."""
        if self._thread is None:
            return
        await asyncio.to_thread(self._listening.wait, CLOSE_TIMEOUT_S)
        if self._stop is not None:
            loop, stop = self._stop
            with contextlib.suppress(RuntimeError):  # its loop has ended
                loop.call_soon_threadsafe(stop.set)
        await asyncio.to_thread(self._thread.join, CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the webhook server did not stop in %.0f s", CLOSE_TIMEOUT_S)

    # In the operator's loop.

    def _published(self, config: kopf.WebhookClientConfig | None, error: BaseException | None) -> None:
        if error is not None:
            self._error = error
        else:
            self._config, self._version = config, self._version + 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # In the server's thread and loop.

    def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.run(self._serve(loop))

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        stop = asyncio.Event()
        self._stop = (asyncio.get_running_loop(), stop)
        self._listening.set()
        serving = asyncio.create_task(self._listen(loop))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (serving, stopping):
            task.cancel()
        await asyncio.gather(serving, stopping, return_exceptions=True)

    async def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        def publish(config: kopf.WebhookClientConfig | None, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the operator's loop has ended
                loop.call_soon_threadsafe(self._published, config, error)

        try:
            async with self._server as server:
                async for config in server(self._answer):
                    publish(config, None)
        except Exception as exc:  # e.g. the port is taken: the run that waits for it fails
            publish(None, exc)

    async def _answer(
        self,
        request: Any,  # an AdmissionReview
        *,
        webhook: str | None = None,
        headers: kopf.Headers | None = None,
        sslpeer: kopf.SSLPeer | None = None,
    ) -> Any:
        assert self._handlers is not None  # set before the server starts
        fn, loop, context = self._handlers

        async def answer() -> Any:
            return await fn(request, webhook=webhook, headers=headers, sslpeer=sslpeer)

        # The task copies the context the call is scheduled in: the run's.
        future = context.copy().run(asyncio.run_coroutine_threadsafe, answer(), loop)
        return await asyncio.wrap_future(future)


@contextlib.asynccontextmanager
async def shared_webhook_server(server: kopf.WebhookServer) -> AsyncIterator[SharedWebhookServer]:
    """``server`` for every kopf run of this block, closed when it ends."""
    shared = SharedWebhookServer(server)
    try:
        yield shared
    finally:
        await shared.close()
