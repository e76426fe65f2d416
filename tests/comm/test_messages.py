"""Payload headers: the cache a pipeline's sends reuse (one header per tag, dtypes and shapes), bounded."""

from __future__ import annotations

import torch

from mpi4dl_nb.comm.messages import HeaderCache, decode_header, encode_header

CPU = torch.device("cpu")


def test_a_cached_header_is_the_encoded_one_and_is_reused_for_the_same_tag_and_shapes():
    cache = HeaderCache()
    payload = (torch.zeros(2, 3), torch.ones(4, dtype=torch.int64))
    first = cache.header(payload, payload, CPU, tag=7)
    assert torch.equal(first, encode_header(payload, CPU, tag=7))
    assert cache.header((torch.ones(2, 3), torch.zeros(4, dtype=torch.int64)), payload, CPU, tag=7) is first
    other_shape = torch.zeros(3, 3)
    assert decode_header(cache.header(other_shape, [other_shape], CPU, tag=7)) == (7, False, [(torch.float32, (3, 3))])
    assert decode_header(cache.header(payload, payload, CPU, tag=8))[0] == 8
    assert decode_header(cache.header(list(payload), payload, CPU, tag=7)) == decode_header(first)


def test_the_cache_never_holds_more_than_its_limit():
    cache = HeaderCache(limit=3)
    for n in range(1, 8):
        t = torch.zeros(n)
        assert decode_header(cache.header(t, [t], CPU, tag=0))[2] == [(torch.float32, (n,))]
        assert len(cache.headers) <= 3
