"""The cache's memory is taken as it is used: a pool the size of a budget costs nothing resident
until its blocks and slots are written, and reads as zeros until then."""

import os

import torch

from hybridrt.bench.fixtures import tiny_text_config
from hybridrt.config import ModelConfig
from hybridrt.statecache.tensors import CacheTensors


def _resident() -> int:
    """This process's resident bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_cache_is_not_resident_until_written():
    config = ModelConfig.from_dict(tiny_text_config())
    slots, blocks = 16384, 262144
    before = _resident()
    t = CacheTensors.allocate(config, blocks, slots, 16, torch.bfloat16, "cpu")
    total = sum(x.numel() * x.element_size() for x in
                [*t.key_caches, *t.value_caches, t.conv_states, t.ssm_states, *t.key_tails,
                 *t.value_tails])
    assert total > 256 * 2**20  # the budget: far more than what becomes resident below
    assert _resident() - before < 16 * 2**20
    # zeros where nothing was written, writes kept, and only what is written becomes resident
    assert not t.ssm_states[:, 17].any() and not t.key_caches[0][123].any()
    t.ssm_states[:, 1:9] = 1.5
    t.key_caches[0][5] = 2.0
    assert (t.ssm_states[:, 1:9] == 1.5).all() and (t.key_caches[0][5] == 2.0).all()
    assert not t.ssm_states[:, 9].any()
    assert _resident() - before < 32 * 2**20
    del t


def test_cache_tensors_are_ordinary_tensors():
    config = ModelConfig.from_dict(tiny_text_config())
    t = CacheTensors.allocate(config, 8, 4, 16, torch.float32, "cpu")
    assert t.ssm_states.dtype == torch.float32 and t.conv_states.dtype == torch.float32
    assert t.ssm_states.is_contiguous() and t.key_caches[0].shape[:2] == (8, 16)
    t.conv_states.copy_(torch.randn_like(t.conv_states))
    moved = t.conv_states[:, 1].clone()
    t.conv_states[:, 2] = moved
    assert torch.equal(t.conv_states[:, 2], moved)
