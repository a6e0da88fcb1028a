"""Keeping the trainer's process flowrl's while an in-process SGLang engine lives in it.

`sglang.Engine` (0.5.21, the pinned version) changes the process it is built in:
- `_set_envs_and_config` (entrypoints/engine.py:1863-1881) installs a SIGQUIT handler that
  kills the whole process tree, the trainer included, when a child fails; its server argument
  `custom_sigquit_handler` (arg_groups/fields/device.py:79) replaces it;
- at its first request the tokenizer manager adds asyncio handlers for SIGTERM (drain, then
  exit) and SIGQUIT (kill the process tree) (managers/tokenizer_manager.py:2316-2324), and its
  subprocess watchdog sends SIGQUIT to the process when a scheduler or detokenizer exits
  (utils/watchdog.py:211-222);
- `Engine.shutdown()` kills every child of the process (engine.py:1406,
  `kill_process_tree(os.getpid(), include_parent=False)`), flowrl's reward scorers included.

`EngineGuard` undoes that, as verl does for its in-process engine (it replaces
`_set_envs_and_config` with a copy without the SIGQUIT handler): the engine starts with
flowrl's SIGQUIT handler, SGLang's asyncio handlers are removed at once and the previous SIGTERM
handler (flowrl's own, `stop.stopped_by_signals`) put back, and a child's death becomes an
`EngineDied` error in the trainer, raised inside the engine call that waits on the dead child
or at the next call, naming host, pool, rank and model; the node call wrapping it adds the node
and where its inputs went, and the run stops as any failed run does (its last checkpoint
intact, resumable). `stop()` ends only the processes the engine started.
Signal handlers are process-wide and only the main thread may set them: off the main thread
(a threaded Ray actor) SGLang installs none either, and none of this applies.
"""

from __future__ import annotations

import signal
import socket
import threading
import weakref

_GUARDS: weakref.WeakSet = weakref.WeakSet()  # the live guards of this process


class EngineDied(RuntimeError):
    """A process of an SGLang engine exited: the engine cannot serve any more."""


def on_sigquit(signum, frame) -> None:
    """flowrl's SIGQUIT handler. SGLang sends SIGQUIT to the process when a child fails: its
    watchdog when a child exited (utils/watchdog.py:221), a scheduler from its exception
    handler before it exits (managers/scheduler.py:6093), a hung scheduler's own watchdog
    (utils/watchdog.py:163). Mark the engines whose processes died, or, when none has died
    yet, every engine of the process (the sender is one of them); raise in the trainer when
    one of them is in a call (it would wait forever). A module-level function: SGLang pickles
    its server arguments, this handler among them, into its spawned children."""
    guards = list(_GUARDS)
    failed = [guard for guard in guards if guard.find_dead()] or guards
    for guard in failed:
        guard.dead = guard.dead or (
            "an SGLang child reported a failure (SIGQUIT: a scheduler's exception or its "
            "watchdog's timeout; SGLang's log above says which)"
        )
    for guard in failed:
        if guard.busy:
            raise guard.error()


class EngineGuard:
    """Process bookkeeping of one engine.

    Args:
        where: "pool <p>, rank <r>, model <m>", for messages.
    """

    def __init__(self, where: str):
        self.where, self.host = where or "this process", socket.gethostname()
        self.busy, self.dead, self.own = False, "", []
        self._before: set = set()
        self._main = threading.current_thread() is threading.main_thread()
        self._term = signal.SIG_DFL

    def server_args(self) -> dict:
        """What the engine's construction needs: flowrl's SIGQUIT handler (main thread)."""
        self._before = {p.pid for p in _children()}
        if not self._main:
            return {}
        self._term = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL  # None: set from C
        return {"custom_sigquit_handler": on_sigquit}

    def started(self, engine) -> None:
        """After construction: note the engine's own processes, and take the signals back."""
        from multiprocessing import resource_tracker

        # the first "spawn" start (SGLang's scheduler) launches the process-wide resource
        # tracker, which flowrl's spawned scorers use too: not the engine's to end
        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        self.own = [p for p in _children() if p.pid not in self._before and p.pid != tracker]
        _GUARDS.add(self)
        manager = getattr(engine, "tokenizer_manager", None)
        if not self._main or manager is None:
            return
        manager.auto_create_handle_loop()  # adds SGLang's asyncio handlers now, once
        for sig in (signal.SIGTERM, signal.SIGQUIT):
            manager.event_loop.remove_signal_handler(sig)
        signal.signal(signal.SIGTERM, self._term)
        signal.signal(signal.SIGQUIT, on_sigquit)

    def find_dead(self) -> str:
        """Describe the first of the engine's processes that exited ("" while all run)."""
        for process in self.own:
            if not self.dead and _exited(process):
                code = _exit_code(process)
                self.dead = f"SGLang's process {process.pid} exited (code {code})"
        return self.dead

    def error(self) -> EngineDied:
        return EngineDied(
            f"{self.dead} on host {self.host} ({self.where}): the engine cannot serve this "
            "model any more, so flowrl stops the run here instead of letting SGLang kill the "
            "trainer's process. Usual causes: out of GPU memory when the KV cache comes back "
            '(set offload = "never" or a smaller rollout_options.mem_fraction_static) or a '
            "model SGLang cannot load. "
            "The run's last checkpoint is intact: resume with flowrl run <graph> --resume "
            "<run dir>"
        )

    def stop(self, engine) -> None:
        """End the engine's own processes (and theirs), not the trainer's other children
        (Engine.shutdown would kill those too), and forget the engine."""
        import psutil

        _GUARDS.discard(self)
        manager = getattr(engine, "tokenizer_manager", None)
        watchdog = getattr(manager, "_subprocess_watchdog", None)
        if watchdog is not None:  # the exits below are expected: no SIGQUIT for them
            watchdog.stop()

        tree = []
        for process in self.own:
            try:
                tree += [process, *process.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=60)


def _children() -> list:
    import psutil

    return psutil.Process().children(recursive=False)


def _exited(process) -> bool:
    import psutil

    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _exit_code(process):
    import psutil

    try:
        return process.wait(timeout=0)
    except (psutil.TimeoutExpired, psutil.NoSuchProcess, ChildProcessError):
        return "unknown"
