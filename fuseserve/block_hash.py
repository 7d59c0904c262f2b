"""Identity of a full KV-cache block for automatic prefix caching (vLLM's block hash, SGLang's radix key).

A block's hash covers everything that changes its K/V: its ``block_size`` token ids, the hash of
the block before it (so equal hashes mean equal whole prefixes) and, through the root, the model id,
extra ids (the request's LoRA adapter, ``lora:NAME``; future multimodal ids) and the request's ``cache_salt`` (vLLM's name: tenants with different
salts never share a block). Only *full* blocks are hashed: a partly filled last block is never
shared. SHA-256 truncated to 63 bits: collisions are negligible (2^-63 per pair) and the value fits
a signed 64-bit field.
"""

from __future__ import annotations

import functools
import hashlib
import json
from array import array
from collections.abc import Sequence

_MASK = (1 << 63) - 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & _MASK


def root_hash(model_id: str, cache_salt: str | None = None, extra_ids: Sequence[str] = ()) -> int:
    """The parent hash of a sequence's first block: model id, extra input ids, cache salt.

    Memoised (a scheduler asks for it whenever a sequence fills a block)."""
    return _root_hash(model_id, cache_salt or "", tuple(extra_ids))


@functools.lru_cache(maxsize=4096)
def _root_hash(model_id: str, cache_salt: str, extra_ids: tuple[str, ...]) -> int:
    # JSON keeps the fields apart: no salt can spell another request's adapter id
    return _digest(json.dumps([model_id, list(extra_ids), cache_salt]).encode())


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block: its token ids chained with ``parent`` (the previous block's hash)."""
    return _digest(array("q", [parent, *token_ids]).tobytes())


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], num_tokens: int, block_size: int, root: int
) -> list[int]:
    """Append to ``hashes`` the hashes of the full blocks of ``token_ids[:num_tokens]`` not hashed yet.

    ``hashes`` holds the hashes of the first ``len(hashes)`` blocks (a sequence keeps it and extends
    it as tokens arrive, so each block is hashed once). Returns ``hashes``.
    """
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes
