"""trainer/weights.py without a server (runs without .venv-sglang): buckets, the flattened wire format, specs.

Covered: buckets keep the state-dict order, respect the byte limit, start anew where the dtype changes (SGLang's
receiver needs every tensor's byte offset aligned to its item size) and give an oversized tensor its own bucket;
a flattened bucket holds each tensor's bytes in order, so slicing it by the (name, dtype, shape) lists gives the
tensors back bit for bit, which is how SGLang's FlattenedTensorBucket.reconstruct_tensors reads it; the dtype
names are the ones SGLang resolves with getattr(torch, name); a group refuses bad arguments before listening.
The transfer itself, against SGLang's receiver: tests/sglang/test_weight_sync.py.
"""

from __future__ import annotations

import pytest
import torch

from trainer.weights import WeightUpdateGroup, flatten_bucket, plan_buckets, tensor_specs


def named():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(4, 4, generator=g),  # 64 bytes
        "b": torch.randn(8, generator=g),  # 32 bytes
        "c": torch.randn(2, 3, generator=g).to(torch.bfloat16),  # 12 bytes
        "d": torch.randn(16, 4, generator=g),  # 256 bytes: larger than the limit below
        "e": torch.arange(5, dtype=torch.int64),  # 40 bytes
    }


def test_buckets_keep_order_limit_size_and_split_on_dtype():
    buckets = plan_buckets(named(), bucket_bytes=100)
    assert [[name for name, _ in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"], ["e"]]
    everything = plan_buckets(named(), bucket_bytes=10**9)
    assert [[name for name, _ in bucket] for bucket in everything] == [
        ["a", "b"],
        ["c"],
        ["d"],
        ["e"],
    ]  # dtypes
    same_dtype = {k: v.float() for k, v in named().items()}
    assert [len(bucket) for bucket in plan_buckets(same_dtype, bucket_bytes=10**9)] == [5]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        plan_buckets(named(), 0)


def test_flattened_bucket_slices_back_into_the_tensors():
    tensors = named()
    for bucket in plan_buckets(tensors, bucket_bytes=10**9):
        flat = flatten_bucket(bucket)
        assert flat.dtype == torch.uint8
        names, dtypes, shapes = tensor_specs(bucket)
        offset = 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            size = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
            assert offset % getattr(torch, dtype).itemsize == 0
            back = flat[offset : offset + size].view(getattr(torch, dtype)).reshape(shape)
            assert torch.equal(back, tensors[name])
            offset += size
        assert offset == flat.numel()


def test_specs_use_sglang_dtype_names():
    names, dtypes, shapes = tensor_specs(named().items())
    assert names == ["a", "b", "c", "d", "e"]
    assert dtypes == ["float32", "float32", "bfloat16", "float32", "int64"]
    assert shapes == [[4, 4], [8], [2, 3], [16, 4], [5]]


def test_group_arguments_are_checked_before_listening():
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        WeightUpdateGroup(world_size=1)
    with pytest.raises(ValueError, match="backend must be 'gloo'"):
        WeightUpdateGroup(world_size=2, backend="mpi")
    with pytest.raises(ValueError, match="group_name must not be empty"):
        WeightUpdateGroup(world_size=2, group_name="")
    group = WeightUpdateGroup(world_size=2, timeout_s=5)
    assert group.master_port > 0  # listening on a free port; nobody joins, so no process group yet
    with pytest.raises(RuntimeError, match="connect\\(\\) has not completed"):
        group.broadcast_bucket([("a", torch.zeros(1))])
    group.destroy()
