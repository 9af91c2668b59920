"""Why a tensor-parallel run failed, in one line.

Each rank describes its own failure (``describe``): an error raised while a collective was in
flight is a timeout or a lost peer, named after that collective, which torch's flight recorder
holds (gloo's own error text names neither the collective nor the peer). The launcher adds the
ranks that died without a word (``died``) and picks the root cause among all of them
(``one_line``): a rank's own error first, then a dead rank, then a timeout, and a lost peer
last, since a peer is lost because some other rank failed first.
"""

from __future__ import annotations

import json
import signal
import traceback
from dataclasses import dataclass

import torch

# gloo's collective timeout (and its next collective's error once the timeout closed the pairs)
# and the store's rendezvous timeouts (init_process_group)
TIMEOUT_MARKERS = ("Timed out waiting", "Application timeout caused pair closure", "timed out after",
                   "Timed out after")
# gloo's words when a peer's socket closes under a collective: the peer exited or was killed
PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
RENDEZVOUS = "the rendezvous (init_process_group)"
FLIGHT_RECORDER_ENTRIES = "64"  # TORCH_FR_BUFFER_SIZE: only the collective in flight is read back


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure. ``kind``: "error" (its own exception), "timeout", "peer_lost" or
    "died" (exited or killed without reporting); ``collective``: the collective in flight, if any."""

    rank: int
    kind: str
    text: str
    collective: str | None = None
    seq: int | None = None
    timeout_s: float | None = None
    detail: str = ""


def _in_flight() -> tuple[str | None, int | None, float | None]:
    """The last collective this process issued (name, sequence number, its timeout in s), from
    the flight recorder; (None, None, None) when it recorded none or this torch lacks it."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None, None, None
    try:
        entries = json.loads(dump(True, False)).get("entries") or []
    except Exception:  # noqa: BLE001  a failed dump only loses the collective's name
        return None, None, None
    if not entries:
        return None, None, None
    last = entries[-1]
    name = str(last.get("profiling_name") or "").split(":")[-1] or None  # "gloo:all_reduce"
    timeout_ms = last.get("timeout_ms")
    return name, last.get("collective_seq_id"), timeout_ms / 1000 if timeout_ms else None


def describe(rank: int, error: BaseException, initialised: bool) -> RankFailure:
    """``error`` as this rank's failure: ``initialised`` says whether the process group was up
    (an error before that is the rendezvous's)."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:  # a wrapper's cause holds gloo's text
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    words = " ".join(str(e) for e in chain)
    first = chain[0]
    text = f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}"
    detail = "".join(traceback.format_exception(first))
    kind = ("timeout" if any(m in words for m in TIMEOUT_MARKERS)
            else "peer_lost" if any(m in words for m in PEER_LOST_MARKERS) else "error")
    if kind == "error":
        return RankFailure(rank, kind, text, detail=detail)
    if not initialised:
        return RankFailure(rank, kind, text, RENDEZVOUS, detail=detail)
    name, seq, timeout_s = _in_flight()
    return RankFailure(rank, kind, text, name or "a collective", seq, timeout_s, detail)


def died(rank: int, exitcode: int | None) -> RankFailure:
    """A rank whose process ended without reporting a result or an error."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = " (the out-of-memory killer's signal)" if -exitcode == signal.SIGKILL else ""
        return RankFailure(rank, "died", f"was killed by {name}{why}")
    return RankFailure(rank, "died", f"exited with code {exitcode} without returning its result")


def _peer_note(peer: RankFailure | None, of: RankFailure) -> str:
    if peer is None or peer.collective in (None, of.collective) and peer.seq == of.seq:
        return ""
    return f" (rank {peer.rank} was in {peer.collective})" if peer.collective else ""


def one_line(failures: list[RankFailure], world: int, timeout_s: float) -> str:
    """The root cause among ``failures`` (in the order the launcher learned of them)."""
    by_kind = {kind: [f for f in failures if f.kind == kind] for kind in ("error", "died", "timeout", "peer_lost")}
    if by_kind["error"]:
        f = by_kind["error"][0]
        return f"rank {f.rank} failed: {f.text}"
    if by_kind["died"]:
        f = by_kind["died"][0]
        lost = [g for g in failures if g.kind in ("peer_lost", "timeout") and g.collective]
        return f"rank {f.rank} {f.text}" + (f"; rank {lost[0].rank} lost it in {lost[0].collective}" if lost else "")
    if by_kind["timeout"]:
        f = by_kind["timeout"][0]
        seconds = f.timeout_s or timeout_s
        reported = {g.rank: g for g in failures}
        # a rank that timed out in the same collective waited too; the others are the ones waited for
        waited = [r for r in range(world) if r != f.rank and not (
            r in reported and reported[r].kind == "timeout" and reported[r].collective == f.collective
            and reported[r].seq == f.seq)]
        peers = " and ".join(f"rank {r}{_peer_note(reported.get(r), f)}" for r in waited) or "another rank"
        return (f"rank {f.rank}: {f.collective} timed out after {seconds:g} s waiting for {peers} "
                f"(raise --tp-timeout if the ranks are only slow, e.g. on a busy machine)")
    f = by_kind["peer_lost"][0]
    return f"rank {f.rank}: {f.collective} failed: another rank closed its connection ({f.text})"


def collective_failed(error: BaseException) -> bool:
    """Whether ``error`` is a process group's collective failing (a timeout, a lost peer)
    rather than the code around it: torch.distributed's own errors, or gloo's words for them
    while a group is up. A target that meets one must not fall back and run the graph again:
    eager would wait on the same broken group, or put the ranks' collectives out of step."""
    if isinstance(error, torch.distributed.DistError):
        return True
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return any(marker in str(error) for marker in TIMEOUT_MARKERS + PEER_LOST_MARKERS)
