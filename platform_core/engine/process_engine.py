"""``ProcessEngine``: an engine core in a process of its own, started and stopped by its front.

What ``serve`` runs by default. The core is a fresh Python (``subprocess``, not a fork: the front
has threads; not ``multiprocessing``, which would re-import the front's main module in the core
and leave a resource-tracker process behind) started from the client's receiving thread, which
lives exactly as long as the core should: the core's ``PR_SET_PDEATHSIG`` fires when the front
goes, not when some caller thread ends. The launch (config, addresses, ``engine_setup``) is
pickled once onto the core's stdin, which then stays open: when the front is gone, however it
died, the core reads it as closed and stops. The core holds the write end of a status pipe: it
says there whether it started (or the typed error that stopped it: bad model path, invalid
config, raised at once by the constructor), and the pipe reads as closed the moment the core
dies. Meanwhile the front loads its own tokenizer from the model's tokenizer files (no weights).

By default the sockets are Unix sockets in a private temporary directory; pass ``addresses``
for ``tcp://`` (then set a ``secret``). ``shutdown`` asks the core to stop, waits, and kills it
after the timeout; a core that dies is reaped by the receiving thread (no zombie).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.core import EngineSetup
from platform_core.engine.core_client import CoreClient
from platform_core.engine.core_entry import CoreLaunch, write_launch
from platform_core.engine.core_messages import ERROR_DECODER, error_from
from platform_core.engine.core_process import CoreAddresses
from platform_core.engine.setup import load_model_tokenizer
from platform_core.errors import EngineDeadError

logger = logging.getLogger("platform_core.engine")

CORE_EXIT_TIMEOUT_S = 10.0  # after saying it stopped, the core has this long to exit
_CORE_MAIN = "from platform_core.engine.core_entry import main; main()"


class ProcessEngine(CoreClient):
    """An ``LLMEngine`` in its own process, behind the ``AsyncEngine`` surface.

    ``engine_setup`` (tests: fault injection, slowed steps) must be picklable: it runs in the
    core process on the engine once built.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        addresses: CoreAddresses | None = None,
        secret: bytes | None = None,
        engine_setup: EngineSetup | None = None,
    ) -> None:
        self._config = config
        self._private_dir = None
        if addresses is None:
            self._private_dir = tempfile.mkdtemp(prefix="platform-core-")
            addresses = CoreAddresses.ipc_in(self._private_dir)
        root = logging.getLogger()
        level = root.getEffectiveLevel() if root.handlers else None
        self._launch = CoreLaunch(config, addresses, secret, engine_setup, level)
        self._process: subprocess.Popen | None = None
        self._status: Connection | None = None
        super().__init__(addresses, secret=secret)

    @classmethod
    def from_config(
        cls, config: EngineConfig, engine_setup: EngineSetup | None = None
    ) -> ProcessEngine:
        """Start an engine core for ``config`` (see the class)."""
        return cls(config, engine_setup=engine_setup)

    @property
    def pid(self) -> int | None:
        """The engine core's process id."""
        return None if self._process is None else self._process.pid

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the core after its current step and wait for it; kill it after ``timeout``."""
        super().shutdown(timeout)
        if self._thread.is_alive():
            logger.warning("the engine core did not stop within %s s; killing it", timeout)
            self._kill()
            self._thread.join(CORE_EXIT_TIMEOUT_S)

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    # ------------------------------------------------------------------ receiving thread
    def _prepare(self) -> None:
        status_fd, core_end = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CORE_MAIN], stdin=subprocess.PIPE, pass_fds=(core_end,)
            )
        finally:
            os.close(core_end)
        self._status = Connection(status_fd, writable=False)
        launch = pickle.dumps((self._launch, core_end, os.getpid()))
        with contextlib.suppress(BrokenPipeError):  # it died at once: the status pipe says so
            write_launch(self._process.stdin.fileno(), pickle.dumps((sys.path, launch)))
        self.tokenizer = load_model_tokenizer(self._config)
        try:
            status = self._status.recv_bytes()
        except EOFError:
            self._process.wait(CORE_EXIT_TIMEOUT_S)
            raise EngineDeadError(f"{self._gone()} while starting") from None
        if status:
            raise error_from(ERROR_DECODER.decode(status))

    def _watched(self) -> list[Any]:
        return [self._status.fileno()]  # reads as closed once the core is gone

    def _gone(self) -> str:
        try:
            code = self._process.wait(CORE_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "the engine core process closed its status pipe"
        if code < 0:
            return f"the engine core process was killed by {signal.Signals(-code).name}"
        return f"the engine core process exited with status {code}"

    def _after_stop(self) -> None:
        if self._process is not None:
            self._process.stdin.close()  # a core still starting stops once it serves
            try:
                self._process.wait(CORE_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not exit; killing it")
                self._process.kill()
                self._process.wait()
        if self._status is not None:
            self._status.close()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
