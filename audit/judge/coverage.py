"""Coverage, a judge of the run rather than of a key: what the master holds against what was audited.

A run is complete only when every key the master holds was audited, or left out on purpose
(`--prefix`/`--match`, `--sample`). Keys the listing cannot show (another tenant's, a key with
no readable replica, a put in flight) are counted from the master's key count, and block the
claim "clean" whatever the filter: nothing tells whether they would have matched it. A copy on
another replica tier that was not read is said, never blocking: no reader can choose that copy.
"""

from __future__ import annotations

from collections import Counter

from audit.blocktables import DEFAULT_TENANT

from audit.sources.census import Census

MEMORY = "memory"
TIER_NAMES = ("memory", "disk", "local_disk", "nof")
REASONS = {  # every reason a key can go unaudited, and whether it keeps a run from being complete
    "outside_filter": False, "not_sampled": False, "replicas_not_read": False,
    "uncounted": True, "other_tenants": True, "not_listed": True, "unread": True, "not_reached": True,
}


def _gap(reason: str, keys: int | None, says: str, how: str, **detail) -> dict:
    return {"reason": reason, "keys": keys, "blocking": REASONS[reason], "says": says, "how": how, **detail}


def _unlisted_gaps(census: Census, unlisted: int) -> list[dict]:
    """Keys counted by the master that neither the listing showed nor a key source named."""
    audited = set(census.audited_tenants)
    silent = [t for t in census.tenants or []
              if t.name != DEFAULT_TENANT and t.name not in audited and t.charged_bytes > 0]
    if silent:
        names = ", ".join(f"{t.name} ({t.charged_bytes:,} bytes charged)" for t in silent)
        return [_gap("other_tenants", unlisted or None,
                     f"{unlisted or 'some'} key(s) the master holds are in tenants the listing cannot show: {names}",
                     f"--tenant {silent[0].name if len(silent) == 1 else 'all'} with a key source naming their "
                     f"keys (--block-tables RECORDER_DIR, --keys FILE)",
                     tenants=[{"name": t.name, "charged_bytes": t.charged_bytes} for t in silent])]
    if not unlisted:
        return []
    if census.tenants is not None:
        return [_gap("not_listed", unlisted,
                     f"{unlisted} key(s) the master holds were neither listed nor named by a key source",
                     "name every tenant's keys: the recorder's records of every producer, or --keys FILE")]
    return [_gap("not_listed", unlisted,
                 f"{unlisted} key(s) the master holds were not listed (no readable replica, or a put in flight)",
                 "run again once the store settles: a put in flight is listed once it ends")]


def replica_tiers(keys, *, every_memory_replica: bool) -> dict[str, dict[str, int]]:
    """Per replica tier: the keys with a replica there, the replicas, and the replicas no read
    reached. A key is read from memory when it has a memory replica (peek reads read each one, a
    lease read one), else once through the client, from the tier of its first replica."""
    tiers = {tier: Counter() for tier in TIER_NAMES}
    if hasattr(keys, "unusual"):  # a KeyTable: the keys with one memory replica are counted at once
        usual, keys = keys.unusual()
        tiers[MEMORY].update(keys=usual, replicas=usual)
    for key in keys:
        counts = Counter(replica.get("tier", MEMORY) for replica in key.replicas)
        read_from = MEMORY if counts[MEMORY] else key.replicas[0].get("tier") if key.replicas else None
        for tier, n in counts.items():
            row = tiers.setdefault(tier, Counter())
            row.update(keys=1, replicas=n)
            if tier != read_from:
                row["not_read"] += n
            elif tier != MEMORY or not every_memory_replica:
                row["not_read"] += n - 1
    return {tier: {"keys": row["keys"], "replicas": row["replicas"], "not_read": row["not_read"]}
            for tier, row in tiers.items()}


def account(census: Census, tally, *, not_reached: int) -> dict:
    """The coverage account of a run (docs/coverage.md); `tally`: its records counted (a Tally)."""
    read_in = tally.read_by_tenant
    unread = tally.unread
    held = census.keys_held
    named = sum(census.named.values())
    gaps = []
    outside = census.outside_filter + census.named_outside_filter
    if outside:
        named_too = f" and {census.named_outside_filter} named" if census.named_outside_filter else ""
        gaps.append(_gap("outside_filter", outside,
                         f"{census.outside_filter} listed{named_too} key(s) are outside --prefix/--match",
                         "drop the filter"))
    if census.not_sampled:
        gaps.append(_gap("not_sampled", census.not_sampled,
                         f"{census.not_sampled} key(s) were left out of the sample",
                         "run without --sample (a --state-dir run reads every new key once)"))
    if held is None:
        gaps.append(_gap("uncounted", None, "the master's /metrics reports no master_key_count: "
                         "what it holds cannot be checked", "run the master with metric reporting on"))
    else:
        gaps += _unlisted_gaps(census, max(held - census.listed - named - census.named_outside_filter, 0))
    if unread:
        gaps.append(_gap("unread", unread, f"{unread} key(s) could not be read (UNREACHABLE, READ_ERROR)",
                         "see each record's error; run again once the holders are back"))
    if not_reached:
        gaps.append(_gap("not_reached", not_reached, f"{not_reached} key(s) were not reached: the scan stopped",
                         "--checkpoint PATH --resume, or a longer --deadline"))
    replicas_unread = {tier: row["not_read"] for tier, row in (census.tiers or {}).items() if row["not_read"]}
    if replicas_unread:
        gaps.append(_gap("replicas_not_read", None, "replicas of audited keys not read: "
                         + ", ".join(f"{n} on {tier}" for tier, n in replicas_unread.items()),
                         "--read-mode peek reads every memory replica; a copy on another tier is read only when "
                         "the key has no memory replica (Mooncake's get reads memory first), or, for a holder's "
                         "SSD copies, with --offload-dir DIR on its host",
                         replicas=replicas_unread))
    tenants = None if census.tenants is None else [
        {"name": t.name, "charged_bytes": t.charged_bytes,
         "audited": t.name == DEFAULT_TENANT or t.name in census.audited_tenants,
         "keys_named": census.named.get(t.name, 0) if t.name != DEFAULT_TENANT else None,
         "keys_read": read_in[None if t.name == DEFAULT_TENANT else t.name],
         "read_mode": None if t.name not in census.audited_tenants else "lease"}
        for t in census.tenants]
    return {
        "keys_held": held,
        "keys_held_readings": {"before_listing": census.keys_before_listing,
                               "after_listing": census.keys_after_listing},
        "keys_listed": census.listed,
        "keys_named": named,
        "keys_read": sum(read_in.values()),
        "keys_vanished": tally.vanished,
        "keys_admin_cannot_answer": census.through_client,
        "tenants": tenants,
        "replica_tiers": census.tiers,
        "not_audited": gaps,
        "complete": not any(gap["blocking"] for gap in gaps),
    }
