"""The prefix cache's lower tiers, built from the engine's options: host memory
(--kv-offload-memory) and disk (--kv-offload-path, --kv-offload-disk), refused where they
cannot work.

Why the CPU engine gets the disk tier only: its KV cache is host memory already, so a host
tier would copy RAM to RAM and hold less than giving those bytes to the pool. It still keeps
a few host slots as the disk tier's staging (a file is read into a slot, checked, then
copied into the pool), which is all --kv-offload-memory sizes there.

Why the disk tier refuses ranks on other hosts: the engine core finds the files a previous
run left (`disk_format.scan`) by reading every rank's directory, so they must be on its
file system.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedserve.config import EngineConfig
from pagedserve.kv_cache import disk_format
from pagedserve.kv_cache.events import MEDIUM_DISK
from pagedserve.kv_cache.host_tier import HostTier
from pagedserve.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class Tiers:
    host: HostTier | None = None
    disk: HostTier | None = None
    disk_dir: str | None = None  # this run's directory (`disk_format.open_run_dir`)
    digest: bytes = b""  # its fingerprint


def build_tiers(config: EngineConfig, executor, model_config: ModelConfig,
                max_model_len: int, enable_events: bool) -> Tiers:
    """The tiers the options ask for (none by default); `executor`: its device type, KV
    dtype and one rank's block bytes."""
    memory, path = config.kv_offload_memory, config.kv_offload_path
    if not memory and path is None:
        return Tiers()
    option = "kv_offload_memory" if memory else "kv_offload_path"
    if not config.enable_prefix_caching:
        raise ValueError(f"{option} keeps the prefix cache's evicted blocks: it needs "
                         "enable_prefix_caching")
    if executor.device_type == "cpu" and path is None:
        raise ValueError("kv_offload_memory: the CPU engine's KV cache is host memory "
                         "already, so a host tier would copy RAM to RAM; give the pool "
                         "those bytes (kv_cache_memory), or use kv_offload_path for a disk "
                         "tier (kv_offload_memory then sizes its staging)")
    block_bytes = executor.block_bytes
    num_slots = memory // block_bytes
    if path is None:
        if num_slots < 1:
            raise ValueError(f"kv_offload_memory of {memory} bytes holds no KV block of "
                             f"{block_bytes} bytes")
        return Tiers(HostTier(num_slots, enable_events, config.block_size))
    # staging: room for the longest prefix loaded at once (more slots, kv_offload_memory,
    # also keep more of a step's evictions: a slot written in a step is not reused in it)
    staging = -(-max_model_len // config.block_size)
    host = HostTier(max(num_slots, staging), enable_events, config.block_size)
    return Tiers(host, *_disk_tier(config, executor, model_config, enable_events))


def _disk_tier(config: EngineConfig, executor, model_config: ModelConfig,
               enable_events: bool) -> tuple[HostTier, str, bytes]:
    if config.tensor_parallel_address is not None:
        raise ValueError("kv_offload_path: the disk tier needs every tensor-parallel rank on "
                         "the engine's host (tensor_parallel_address starts them elsewhere)")
    num_slots = config.kv_offload_disk // executor.block_bytes
    if num_slots < 1:
        raise ValueError(f"kv_offload_disk of {config.kv_offload_disk} bytes holds no KV "
                         f"block of {executor.block_bytes} bytes")
    fields = fingerprint_fields(config, executor, model_config)
    run_dir = disk_format.open_run_dir(config.kv_offload_path, fields)
    _, digest = disk_format.fingerprint(fields)
    disk = HostTier(num_slots, enable_events, config.block_size, MEDIUM_DISK)
    if config.prefix_caching_hash_seed is None:
        logger.warning("kv offload: no prefix_caching_hash_seed, so block hashes are random "
                       "per run and the blocks on disk cannot be found after a restart")
    else:
        disk.restore(disk_format.scan(run_dir, digest, config.tensor_parallel_size, num_slots))
        logger.info("kv offload: %d blocks on disk in %s from an earlier run", len(disk),
                    run_dir)
    return disk, str(run_dir), digest


def fingerprint_fields(config: EngineConfig, executor, model_config: ModelConfig) -> dict:
    """Everything that shapes a disk block's bytes and its hash (a draft model's or
    EAGLE-3 heads' KV is part of each block)."""
    fields = {"model": str(config.model), "quantization": config.quantization,
              "dtype": executor.dtype, "kv_cache_dtype": executor.kv_cache_dtype,
              "block_size": config.block_size, "block_bytes": executor.block_bytes,
              "num_layers": model_config.num_layers, "num_kv_heads": model_config.num_kv_heads,
              "head_dim": model_config.head_dim, "tensor_parallel_size":
              config.tensor_parallel_size, "hash_algo": config.prefix_caching_hash_algo,
              "hash_seed": config.prefix_caching_hash_seed}
    spec = config.speculative_config
    if spec is not None and spec.on_device:
        fields["draft"] = spec.model
    return fields
