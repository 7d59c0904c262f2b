"""Who owns a request entry: claims of a dead scheduler's requests, and the owner keeping its own.

A request entry of ``messages.REQUESTS`` is owned by the scheduler it is pending for in the consumer
group. Its **delivery count** (Redis counts each delivery: the first read, then every ``XAUTOCLAIM``)
is the request's fencing token: it grows with every takeover. The scheduler stamps it on the
request's token events (``TokenEvent.fence``) and the gateway drops the events of a lower fence than
it has seen (``frontend.output.OutputState``), so a stalled scheduler whose requests a peer took over
cannot reach a client once the peer has spoken.

- ``claim_command`` / ``parse_claim``: ``XAUTOCLAIM`` of entries idle past the claim idle time (their
  owner missed its beats: dead or stalled), with each claimed entry's delivery count, in one script.
- ``touch_commands`` / ``parse_touch``: the owner's heartbeat re-delivers to itself only the entries it
  still owns (resetting their idle time) and learns which ones a peer has claimed meanwhile, so it
  drops them instead of taking them back (a plain ``XCLAIM`` would steal them back from the peer).
- ``claim_orphans``: a scheduler's periodic claim of dead schedulers' requests, as many as it has
  room for.
- ``ack_command``: a finished request's entry is acknowledged and deleted only while it is still
  pending for this scheduler. A stalled scheduler that comes back and finishes a request a peer has
  taken over meanwhile must not remove the peer's entry: were the peer to die next, nothing would be
  left to claim, and the peer's own heartbeat would take the entry for one claimed away and drop the
  request.
"""

from __future__ import annotations

import logging

import redis

from fuseserve import messages

log = logging.getLogger(__name__)

#: XAUTOCLAIM (ARGV: group, consumer, min idle ms, start, count), then each claimed entry's delivery
#: count: ``{next start, entries, counts}``. An entry deleted while pending is nil in Redis 6.2's
#: reply (Redis 7 leaves it out): its count is 0.
_CLAIM_LUA = """
local reply = redis.call('xautoclaim', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local counts = {}
for i, entry in ipairs(reply[2]) do
  counts[i] = 0
  if entry then
    local p = redis.call('xpending', KEYS[1], ARGV[1], entry[1], entry[1], 1)
    if p[1] then counts[i] = p[1][4] end
  end
end
return {reply[1], reply[2], counts}
"""
#: ARGV: group, consumer, entry ids. Re-delivers to the consumer (XCLAIM JUSTID: idle time reset,
#: delivery count kept) the ids still pending for it; returns the ids that are not (claimed by a peer,
#: or acknowledged).
_TOUCH_LUA = """
local mine, lost = {}, {}
for i = 3, #ARGV do
  local p = redis.call('xpending', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if p[1] then mine[#mine + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
end
for i = 1, #mine, 500 do
  redis.call('xclaim', KEYS[1], ARGV[1], ARGV[2], 0, unpack(mine, i, math.min(i + 499, #mine)))
end
return lost
"""

#: ARGV: group, consumer, entry ids. Acknowledges (XACK) and deletes (XDEL) the ids still pending for
#: the consumer; returns how many. Sent with EVAL: it runs in the loop's pipelined publish, where a
#: NOSCRIPT reply (Redis restarted) would only come back with the next call.
_ACK_LUA = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('xpending', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if p[1] then
    redis.call('xack', KEYS[1], ARGV[1], ARGV[i])
    redis.call('xdel', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
"""

TOUCH_BATCH = 500  # entry ids per touch script call


def ack_command(consumer: str, entry_ids: list[str]) -> tuple:
    """The command that acknowledges and deletes the request entries ``entry_ids`` that are still
    ``consumer``'s (its reply: how many were)."""
    return ("EVAL", _ACK_LUA, 1, messages.REQUESTS, messages.SCHEDULER_GROUP, consumer, *entry_ids)


class RequestClaims:
    """The two scripts, registered on ``r`` (their SHA1s are sent with ``EVALSHA``; a Redis that lost
    them answers NOSCRIPT, and ``load`` puts them back)."""

    def __init__(self, r):
        self.r = r
        self._claim = r.register_script(_CLAIM_LUA)
        self._touch = r.register_script(_TOUCH_LUA)

    def load(self) -> None:
        """Load both scripts into Redis (after a NOSCRIPT reply: Redis restarted)."""
        self.r.script_load(_CLAIM_LUA)
        self.r.script_load(_TOUCH_LUA)

    def reload_if_lost(self, replies: list) -> list:
        """``replies`` without the NOSCRIPT errors among them; when there was one, the scripts are
        loaded again (Redis restarted: the next round runs them)."""
        kept = [rep for rep in replies if not isinstance(rep, redis.exceptions.NoScriptError)]
        if len(kept) < len(replies):
            self.load()
        return kept

    def claim_command(self, consumer: str, count: int, idle_ms: int, start: str = "0-0") -> tuple:
        """``XAUTOCLAIM`` of request entries idle ``idle_ms`` (a dead or stalled scheduler's) for
        ``consumer``, at most ``count``, from ``start``; its reply goes through ``parse_claim``."""
        group = messages.SCHEDULER_GROUP
        return ("EVALSHA", self._claim.sha, 1, messages.REQUESTS, group, consumer, idle_ms, start, count)

    def touch_commands(self, consumer: str, entry_ids: list[str]) -> list[tuple]:
        """The commands that re-deliver ``consumer``'s pending entries ``entry_ids`` to itself; their
        replies go through ``parse_touch``."""
        group, sha = messages.SCHEDULER_GROUP, self._touch.sha
        return [
            ("EVALSHA", sha, 1, messages.REQUESTS, group, consumer, *entry_ids[i : i + TOUCH_BATCH])
            for i in range(0, len(entry_ids), TOUCH_BATCH)
        ]


def parse_claim(reply: list) -> tuple[str, list[tuple[str, dict, int]]]:
    """``(next start id, [(entry_id, fields, delivery count), ...])`` of a claim script's reply. An
    entry deleted while pending is left out (Redis 7) or has fields ``{}`` (Redis 6.2 answers nil in
    its place, without the id: left out too)."""
    start, entries, counts = reply[0], reply[1], reply[2]
    claimed = []
    for entry, count in zip(entries, counts, strict=True):
        if not entry:
            continue
        fields = dict(zip(entry[1][::2], entry[1][1::2], strict=True)) if entry[1] else {}
        claimed.append((entry[0], fields, int(count)))
    return start, claimed


def parse_touch(replies: list) -> list[str]:
    """The entry ids the touch scripts found no longer this scheduler's (one list per reply)."""
    return [entry_id for reply in replies for entry_id in reply]


def drop_lost(service) -> None:
    """In ``service``'s loop (a ``SchedulerService``): drop the requests its heartbeat found claimed
    by a peer (``note_lost_requests``): no event, no ack; the peer serves them now."""
    if not service.lost_entries:
        return
    lost = set()
    while service.lost_entries:
        lost.add(service.lost_entries.popleft())
    by_entry = {o.entry_id: seq_id for seq_id, o in service.owners.items()}
    dropped = [by_entry[e] for e in lost if e in by_entry]
    for seq_id in dropped:
        service.core.abort(seq_id)  # no event, no ack: the request is the peer's now
        del service.owners[seq_id]
        service.metrics.forget(seq_id)
    if dropped:
        log.warning("a peer took over %d of this scheduler's requests (it stalled); dropped", len(dropped))
        service.num_lost_to_peers += len(dropped)
        service.room_changed = True


def orphans_command(service, start: str = "0-0") -> tuple:
    """The claim of ``service``'s (a ``SchedulerService``) share of dead schedulers' pending requests:
    as many as it has room for (at most 100), idle past its claim idle time, from ``start``."""
    idle_ms = service.timings.claim_idle_ms
    return service.claims.claim_command(service.consumer, min(100, service.room()), idle_ms, start)


def claim_orphans(service, first_reply=None) -> None:
    """Take over pending requests of dead schedulers into ``service`` (a ``SchedulerService``), as
    many as there is room for. Live schedulers keep theirs fresh (``touch_commands``).
    ``first_reply``: the raw reply of the first ``orphans_command`` when it was sent already (the
    periodic round trip)."""
    start = "0-0"
    while first_reply is not None or service.room() > 0:
        if first_reply is None:
            reply = service.conn.call([orphans_command(service, start)])[0]
        else:
            reply, first_reply = first_reply, None
        if not service.claims.reload_if_lost([reply]):
            return  # Redis restarted without the script: claimed at the next round
        if isinstance(reply, redis.ResponseError):
            raise reply  # NOGROUP: ``run`` recreates the group
        start, entries = parse_claim(reply)
        if entries:
            log.warning("took over %d requests of a dead scheduler", len(entries))
            service.num_taken_over += len(entries)
        service.add_requests(entries, taken_over=True)
        if start == "0-0" or not entries:
            break
