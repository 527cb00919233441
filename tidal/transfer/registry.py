"""Transfer backends by name, imported only when chosen (mooncake and nixl are optional)."""

from __future__ import annotations

import importlib
from typing import Optional

from tidal.transfer.base import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    TransferConfig,
)

# name -> "module:Transport class"; "fake" has its own manager
BACKENDS: dict[str, str] = {
    "fake": "tidal.transfer.fake:FakeKVManager",
    "shm": "tidal.transfer.shm:ShmTransport",
    "tcp": "tidal.transfer.tcp:TcpTransport",
    "mooncake": "tidal.transfer.mooncake:MooncakeTransport",
    "nixl": "tidal.transfer.nixl:NixlTransport",
}


def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def create_kv_manager(backend: str, args: KVArgs, mode: str, bootstrap_port: Optional[int] = None,
                      config: Optional[TransferConfig] = None) -> BaseKVManager:
    """The KV manager of one server rank. Prefill managers register with the bootstrap
    server on 127.0.0.1-or-args.host:bootstrap_port (None: do not register)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose from {sorted(BACKENDS)}")
    if backend == "fake":
        return _load(BACKENDS["fake"])(args, mode)
    from tidal.transfer.manager import KVManager

    transport_cls = _load(BACKENDS[backend])  # ImportError names the missing optional package
    return KVManager(backend, transport_cls, args, mode, bootstrap_port, config)


def create_kv_sender(manager: BaseKVManager, bootstrap_addr: str, bootstrap_room: int) -> BaseKVSender:
    """Same as KVSender(...): a fake sender for bootstrap host 2.2.2.2."""
    return manager.make_sender(bootstrap_addr, bootstrap_room)


def create_kv_receiver(manager: BaseKVManager, bootstrap_addr: str, bootstrap_room: int) -> BaseKVReceiver:
    return manager.make_receiver(bootstrap_addr, bootstrap_room)
