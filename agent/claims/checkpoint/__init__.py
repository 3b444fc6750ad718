"""The crash-safe record of prepared claims (``<state dir>/checkpoint.json``): a snapshot and a journal.

The first line is the snapshot: format version, the node's boot ID and the entries per claim UID,
with a sha256 checksum over the canonical JSON of boot ID and entries (the whole file of earlier
releases, which a fresh snapshot still is). Every change after it is appended as one more line,
a journal record (``op`` ``put`` with the entry, or ``delete``) with a sha256 checksum of its own;
replaying the records over the snapshot gives the entries. An append and one fsync cost about a
quarter of the temp file, fsync, rename and directory fsync of a new file (0.10-0.13 against
0.38-0.54 ms on an ext4 disk here, ``benchmarks/README.md``); the file is compacted into a new
snapshot, written that crash-safe way, once the journal outgrows the snapshot (and at start).

Each claim moves ``PrepareStarted`` (written before the backend or CDI is touched) ->
``PrepareCompleted``. A last record without its line end is one whose write never finished (the
power went while it was written: its change was never acknowledged) and is dropped; any damage, or a
file that cannot be read or parsed (within `MAX_CHECKPOINT_BYTES` and the depth limit of
`agent.core.boundedfile`), moves the file aside under a name of its own and the agent rebuilds the
entries from the CDI specs (never a crash loop, see `agent.claims.state.startup`). Writes are coalesced:
concurrent changes share one write (group commit), so 100 claims prepared at once do not mean 200
fsyncs. A change may bring a blocking action (the CDI spec of a completed claim) that the write
carrying the change runs first in its worker thread: one thread hop for both, and the spec is on
disk before any checkpoint names the claim completed.

Agents before the journal read only a snapshot: while another agent shares the file (a rolling
update's other pod, `PeerWatch`), every write is a snapshot (README, "Upgrades and rollbacks").

The package, lowest first: `format` (entries; snapshot and journal lines), `file` (reading at
start, moving a bad file aside, appends and compactions), `commit` (one group commit in its worker
thread; `PeerWatch`) and `store` (`CheckpointStore`: the entries in memory and on disk).
"""
