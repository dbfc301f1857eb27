"""One message for a command that torchrun runs as several processes (ranks).

Every rank runs the same command: a bad config key stops all of them with the same error, each
printing it; a rank that stops alone (Ctrl-C on it, a fault of its own) leaves the others to fail
in their next collective operation with gloo's (or nccl's) error and its traceback. The user
should read one line, the one a single process prints, from rank 0:

* A rank other than 0 that stops (``say``) notes its exit status and message in torchrun's store
  (the key-value store its processes share, hosted by torchrun itself, so that it outlives
  them), leaves the process group, so that the operation its peers wait in fails at once rather
  than at the timeout, and waits quietly for rank 0 to report (at most ``WAIT_S`` seconds; then
  it prints its own line). It stays alive meanwhile because torchrun ends every process once one
  has exited, which could cut rank 0 off before its line.
* Rank 0 prints its line, its own stop or a peer's (``peer_stop``: which rank stopped and why,
  or that one vanished), then tells the others that the message is out.

Without torchrun's store (one process, or another launcher) every process prints its own line,
as before. torchrun's summary of the failed processes, with the traceback of its own
ChildFailedError, is printed by torchrun's process after the ranks' line: nothing here reaches it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from .errors import AtencionError, Interrupted

WAIT_S = 30.0  # how long a rank that stopped waits for rank 0's report before printing its own
LOST = ("Connection closed by peer", "Connection reset by peer")  # gloo's words for a peer that left
_victim = False  # this process stops because a peer did (peer_stop): it has nothing to note


@dataclass
class Stop:
    """Why another rank stopped: its rank (None: it vanished without a note, killed or crashed),
    exit status (130: Ctrl-C) and message (or the collective operation's error)."""

    rank: int | None
    status: int
    message: str

    def error(self, when: str, where: str) -> AtencionError:
        """The error rank 0 stops with: ``when`` it happened (at step N), and ``where`` the run
        stands (its last checkpoint, the command that goes on)."""
        if self.status == 130:
            return Interrupted(f"interrupted {when} by a Ctrl-C (SIGINT) to rank {self.rank}; {where}")
        if self.rank is None:
            return AtencionError(f"another process stopped {when} ({self.message}); {where}")
        return AtencionError(f"rank {self.rank} stopped {when}: {self.message}")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes, as torchrun's environment gives them."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _store():
    """A client of torchrun's store (None without one), its keys under this attempt's prefix:
    torchrun may restart the ranks (--max-restarts), and a new attempt starts with no notes."""
    if rank_and_world()[1] <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=5))
    except (KeyError, ValueError, RuntimeError):
        return None
    return dist.PrefixStore(f"atencion/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


@contextmanager
def _ctrl_c_ignored():
    """Within: SIGINT is ignored. torchrun passes the terminal's Ctrl-C on to the ranks, which
    had it already: a second KeyboardInterrupt must not cut the report short."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def say(line: str, status: int, message: str) -> None:
    """Print ``line``, a command's last (``message`` with its command's name), on stderr once for
    all the ranks: rank 0 prints it; another rank notes ``status`` and ``message`` for rank 0 and
    prints nothing if rank 0 reports (see the module's docstring)."""
    rank, _ = rank_and_world()
    store = _store()
    if store is None:
        print(line, file=sys.stderr)
        return
    with _ctrl_c_ignored():
        if rank == 0:
            print(line, file=sys.stderr, flush=True)
            _tell(store)
            return
        if not _victim:
            _note(store, rank, status, message)
        _leave_group()
        if not _told(store):
            print(f"{line} (rank {rank})", file=sys.stderr)


def peer_stop(err: BaseException) -> Stop | None:
    """Why the collective operation that raised ``err`` failed when another rank stopped: its note
    (the lowest rank that left one), or a Stop without a rank when ``err`` says a peer left
    without one; None when ``err`` is not about another rank (a fault of this process's own)."""
    global _victim
    import torch.distributed as dist

    rank, world = rank_and_world()
    if not isinstance(err, RuntimeError) or world <= 1 or not dist.is_initialized():
        return None
    note = _first_note(rank, world)
    if note is not None:
        _victim = True
        return note
    if isinstance(err, getattr(dist, "DistError", ())) or any(words in str(err) for words in LOST):
        _victim = True
        return Stop(None, 1, str(err).splitlines()[0] if str(err) else type(err).__name__)
    return None


def _first_note(rank: int, world: int) -> Stop | None:
    """The note of the lowest other rank that left one in torchrun's store; None: none did."""
    store = _store()
    if store is None:
        return None
    try:
        for k in range(world):
            if k != rank and store.check([f"stop/{k}"]):
                note = json.loads(store.get(f"stop/{k}"))
                return Stop(k, note["status"], note["message"])
    except RuntimeError:  # torchrun is gone
        pass
    return None


def _note(store, rank: int, status: int, message: str) -> None:
    try:
        store.set(f"stop/{rank}", json.dumps({"status": status, "message": message}))
    except RuntimeError:  # torchrun is gone: nobody to tell
        pass


def _tell(store) -> None:
    try:
        store.set("reported", "1")
    except RuntimeError:
        pass


def _told(store) -> bool:
    """Whether rank 0 reports within WAIT_S seconds."""
    try:
        store.wait(["reported"], timedelta(seconds=WAIT_S))
        return True
    except RuntimeError:  # the timeout (DistStoreError), or torchrun gone
        return False


def _leave_group() -> None:
    """Leave the process group, if this process joined one over gloo, so that the collective
    operation its peers wait in fails at once ("Connection closed by peer") rather than at its
    timeout (30 minutes). destroy_process_group does not close gloo's connections while FSDP or
    DDP still holds the group, so they are shut down here: every TCP connection of this process
    but those to torchrun's store. Under nccl, or without /proc, the peers are left to their
    timeout: rank 0 then does not report, and this rank prints its own line after WAIT_S."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        _shut_down_connections(keep_port=int(os.environ.get("MASTER_PORT", "0")))


def _shut_down_connections(keep_port: int) -> None:
    """Shut down (not close: the descriptors stay their owners') every TCP connection of this
    process but those to ``keep_port``."""
    try:
        descriptors = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux
        return
    for fd in descriptors:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket, or closed since
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                    and sock.getpeername()[1] != keep_port:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected: a listening socket
            pass
        finally:
            sock.detach()
