"""KV transfer for prefill/decode disaggregation.

Contract (everything the scheduler calls is non-blocking; network and copies run in
background threads):

- `KVPoll(IntEnum)`: Failed=0 < Bootstrapping=1 < WaitingForInput=2 < Transferring=3
  < Success=4. `poll_and_all_reduce(pollers, comm=None)` polls each and, with a
  TP communicator, agrees across ranks (MIN; a failure on one rank fails all of them).
- `MetadataBuffers(size, max_top_logprobs=20)`: `alloc() -> int | None`, `free(idx)`,
  `set(idx, MetadataRecord)`, `get(idx) -> MetadataRecord`, `available_size()`.
  `MetadataRecord(output_id, cached_tokens, logprob, top_logprobs_val, top_logprobs_idx,
  bootstrap_room)`.
- `KVArgs(engine_rank, kv_pool, metadata, page_size, kv_dtype, host="127.0.0.1",
  tp_size=1, dp_size=1, pp_size=1, bootstrap_key=None)`; a prefill manager sends
  `bootstrap_key` as `Authorization: Bearer` with PUT/DELETE /route.
- `create_kv_manager(backend, args, mode, bootstrap_port=None) -> manager`, backend in
  fake | shm | tcp | mooncake | nixl (mooncake and nixl imported only when chosen).
  A prefill manager binds a ZMQ control endpoint and registers its rank with the
  bootstrap server at args.host:bootstrap_port (PUT /route). `manager.stats() -> dict`
  (transferred_bytes, succeeded, failed_bootstraps, failed_transfers, latencies_s,
  latency_histogram); `manager.shutdown()` stops every thread, socket and mapping it owns.
- Prefill, per request: `KVSender(manager, "host:port", room)`. `poll()`: Bootstrapping
  until decode's destination for the room arrived, then WaitingForInput; after
  `send(..., is_last=True)` Transferring until decode confirmed every page and the
  metadata landed: Success. `init(num_kv_pages, metadata_index)` once bootstrapped;
  `send(kv_page_indices: int64 array, is_last)` once per finished chunk with its whole
  pages in order (may be empty); the last send also carries the metadata slot's record.
- Decode, per request: `KVReceiver(manager, "host:port", room)`. `poll()`: Bootstrapping
  (bootstrap lookup and prefill handshake in the background; refused with a Failed
  reason if page size or KV dtype differ) -> WaitingForInput -> `init(dst_pages,
  metadata_index)` -> Transferring -> Success once every page and the metadata record
  are in this server's pool and metadata slot.
- Both: `failure_exception() -> Exception | None` (the reason), `abort()` (the partner is
  told and fails too; a decode room aborted while its prefill is still being looked up
  tells that prefill once found). Failed after TIDAL_DISAGG_BOOTSTRAP_TIMEOUT (30 s, no partner)
  or TIDAL_DISAGG_WAITING_TIMEOUT (300 s after init, no completion; as SGLang's), on the partner's
  failure or abort, and at random with TIDAL_DISAGG_TEST_FAILURE_PROB
  (or DISAGGREGATION_TEST_FAILURE_PROB) per request.
  A decode room that failed while prefill may still be writing into its pages keeps
  polling Transferring until prefill confirms it stopped (or TIDAL_DISAGG_ABORT_GRACE,
  2 s, passes): when poll() says Failed its pages can be freed.
- Bootstrap host 2.2.2.2 always gets fake senders/receivers (no network).
- Backends: fake (nothing moves), shm (same host; the decode pool must be built with
  MHATokenToKVPool(..., shm_name=...)), tcp (any hosts; ZMQ streams), mooncake, nixl.
- Other knobs: TIDAL_DISAGG_HEARTBEAT_INTERVAL (5 s), TIDAL_DISAGG_TRANSFER_THREADS (2),
  TIDAL_DISAGG_TCP_CHECKSUM=1 (CRC32 per tcp message; sizes are always checked),
  TIDAL_DISAGG_ADVERTISE_HOST (address peers use when host is 0.0.0.0),
  TIDAL_MOONCAKE_PROTOCOL / TIDAL_MOONCAKE_DEVICE / TIDAL_MOONCAKE_MAX_BATCH,
  TIDAL_NIXL_PROGRESS_INTERVAL.
- `BootstrapServer(host, port, key=None)`: `start()` (RuntimeError if the port is taken),
  `stop()`; routes PUT/GET/DELETE /route, GET /health, POST /heartbeat. With a key,
  PUT/DELETE /route without `Authorization: Bearer KEY` answer 401. A server's key is
  `--disaggregation-bootstrap-key`, else a random one made at launch for all its ranks.
"""

from tidal.transfer.base import (
    FAKE_BOOTSTRAP_HOST,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVTransferError,
    TransferConfig,
)
from tidal.transfer.bootstrap import BootstrapServer
from tidal.transfer.manager import KVManager, KVReceiver, KVSender
from tidal.transfer.metadata import MetadataBuffers, MetadataRecord
from tidal.transfer.poll import KVPoll, poll_and_all_reduce
from tidal.transfer.registry import (
    BACKENDS,
    create_kv_manager,
    create_kv_receiver,
    create_kv_sender,
)

__all__ = [
    "BACKENDS",
    "FAKE_BOOTSTRAP_HOST",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "BootstrapServer",
    "KVArgs",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "MetadataBuffers",
    "MetadataRecord",
    "TransferConfig",
    "create_kv_manager",
    "create_kv_receiver",
    "create_kv_sender",
    "poll_and_all_reduce",
]
