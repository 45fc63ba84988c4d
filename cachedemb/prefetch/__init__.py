"""The look-ahead pipeline: `cachedemb.prefetch(batches, modules, depth, horizon)` read ids ahead, admit each
window's rows in one batched transfer.

Two look-aheads with different costs are kept apart:

- the id horizon H: a batch's ids are read before it is trained, so eviction knows each resident row's next use
  among the next H batches (`NextUseTracker`, O(the horizon's distinct ids), never per table row);
- the admission depth K <= depth: the union of a window of K batches is admitted in one batched transfer and
  protected until the window is over, so every forward in it is all hits. K is chosen from what fits: a window of
  one batch may fill a cache (that batch must be resident for its forward anyway: Belady-OPT's own constraint), a
  window of more batches may take half of it (more would leave the policy no choice); a batch that does not fit
  even alone takes the modules' per-batch path (misses beyond the free slots served from the host). The union is
  built once, batch by batch, stopping at the first that does not fit: no window is planned, shrunk and planned
  again.

Where each stage runs (the `cache_stats()["seconds"]` entry that times it in brackets):

training thread (the caller's), per batch, when the loop asks for the next batch (so the previous batch's
backward has been issued):
1. read [prefetch_read]: pull the next batch from the source and extract its ids per cache
   (`module.prefetch_targets(batch)` or `ids=`). Module code, so it stays here, in batch order: a sharded model's
   input all-to-all, RNG use and module state happen as without prefetch. Batches are read horizon + 2 x depth
   ahead of the one yielded. The ids are copied, host ids on the host and CUDA ids into pinned host memory without
   blocking (an event marks the copy), and handed to the read-ahead thread.
2. at a window start: admit the window on the current stream (`EmbeddingCache.admit_window`: `plan_window` picks
   victims among rows no window in use needs and updates slot metadata and the index, `transfer_window` moves the
   rows, `activate_window` protects exactly the window) [admit_window, next_use_refresh, window_protect], or switch
   to the window planned one window ago (`activate_window`: the current stream waits for its transfer's event).
   Then snapshot the slot ids (a non-blocking copy) for the next uses of the next window.
3. overlap (default for CUDA caches, and for CPU caches of a threaded pipeline): if the next window fits beside
   this one (the union test on the two windows' rows; `staging_rows` slots beyond the cache's rows take the new
   rows, trimmed back at the next activation: docs/prefetch.md, overlap.py), plan it now and move its rows
   meanwhile: on CUDA on a side stream (which first waits for everything
   issued on the current stream; `record_stream`; an event); on CPU on a host thread ("cachedemb-window-copy"),
   started by the next announced forward once its module has counted who holds the host table (a copy in flight
   holds views of it: a later forward whose count finds an extra holder while a copy runs waits for the copy and
   counts again), and waited for when the window is activated [transfer_wait]; the read-ahead thread starts no
   task while a copy runs (on a small machine the two would share a core, and the next window waits for the
   copy). A CPU cache with counts on the host is planned on that thread too (`EmbeddingCache.plan_in_background`:
   it waits for the next uses there, chooses victims among unprotected slots, which the current window's batches
   never touch, snapshots the slots for the window after, then moves the rows; its counter bumps and the
   generation land when the window is activated): the training thread neither plans nor waits for next uses, and
   every decision is the one planning here would make. A CPU cache behind a host tier (cachedemb.storage, which
   stages host rows meanwhile) moves them on this thread at once.
4. hand-off: give each cache this batch's unique ids, and inside a window their slots, if the read-ahead thread
   has them (never waited for): its forward then neither sorts its ids nor looks them up (cache/ahead.py; a CPU
   cache with counts on the host).
5. yield the batch: its forward and backward run on the current stream.

read-ahead thread (one, "cachedemb-read-ahead"; tasks in submission order, forward uniques first):
- per batch: each cache's distinct ids (a sort) [prefetch_unique], `NextUseTracker.enter` [prefetch_next_use];
- per window: its depth and union, from the tracker's use bits (windows.py) [prefetch_window_plan];
- per window: the next uses, as of the next window's start, of the ids in the slot snapshot
  [prefetch_next_use_query];
- per batch, two before it is yielded: `unique_ids` of its ids for the forward's hand-off [prefetch_forward_unique].
The training thread waits for it only for what it needs at once: a window's plan, a window's next uses
[prefetch_wait]. Torch ops release the GIL, so on a multi-core machine the thread runs beside the step; the id
map's and use bits' per-id loops run in C where a compiler is at hand (host_map.c, one pass per id, ~2x less
thread time than the torch reference, which runs elsewhere).
For CUDA caches the same thread does this work on the GPU instead (device_read_ahead.py, "cachedemb-device-
read-ahead"; `CACHEDEMB_READ_AHEAD=host|device` chooses): each batch's distinct ids sorted once on the device and
kept for the horizon, unions and next uses as binary searches into them on a side stream, the results handed
over in pinned host memory; the same windows and next uses as the host tracker's (tested), at a few launches per
batch instead of ~25 ms of a core per 426k ids (which bound a GPU step). No forward hand-off there.

Hazards ruled out (each is tested):
- a row an in-flight batch needs being evicted: a window's rows are protected until it ends, and victims never
  come from protected slots;
- the backward of batch i racing the admission for later batches: admissions happen when the loop asks for the
  next batch, the side stream waits for the current stream, and victims exclude both windows;
- a batch keeping slot locations a later admission changed: the module's generation check refuses that backward
  rather than corrupting rows;
- a forward of other ids inside the loop (an eval batch) reading a host row the side stream is still writing
  back: the first forward per cache after a batch is yielded is taken as that batch's (all hits); any further one
  waits for the transfer; on CPU so does an announced forward whose ids were not all read ahead (a miss served
  from the host), and every whole-cache operation (flush, reload, counts halved, rows re-read or dropped);
- the read-ahead thread and the training thread touching the same state: the thread works on its own copies of
  the ids and on snapshots of the slot ids, and its results reach the loop only through futures; a hand-off is
  taken only if its ids equal the forward's and every slot still holds its id;
- decisions that depend on thread timing: a query reads only the use bits of the batches it asks about, so the
  windows, next uses and victims are the same however far ahead the thread has read (the same as doing its work
  inline);
- errors and early exits: an error reading a batch is raised in the loop when it reaches that batch, an error on
  the read-ahead thread at the next batch; on `break`, an exception or `close()` the thread is stopped and joined
  and window protection, the hand-off and the caches' ownership are released.

The ids a batch is read with must be the ids its forward looks up (the default extraction guarantees it).

On a sharded model (`cachedemb.distributed.shard`), reading a batch ahead runs its input all-to-all, as torchrec's
sparse-dist train pipeline does: each rank's horizon and windows see the ids it owns after the exchange, and the
batch's forward (the first after its yield) uses the exchanged input.

Modules: `pipeline` (Prefetcher, prefetch: the training thread's side), `overlap` (its overlap decisions and copy
rule as plain logic), `read_ahead` (the thread), `next_use`
(NextUseTracker), `id_map` (the host hash map under it), `host_map` (their per-id loops in C), `windows` (window
depth and union).
May import: cachedemb.cache, cachedemb.kernels (the torch reference of unique_ids) and torch; nothing imports it but
the facade and cachedemb.distributed.
"""
from cachedemb.prefetch.ids_check import PrefetchIdsWarning
from cachedemb.prefetch.next_use import NextUseTracker
from cachedemb.prefetch.pipeline import Prefetcher, prefetch

__all__ = ["NextUseTracker", "PrefetchIdsWarning", "Prefetcher", "prefetch"]
