"""Where a graphed Linear's graphs read a tensor (``lowprec.linear.graph_sources``): where
it lies, checked by address and layout, or from a buffer copied into once per tensor and
version."""

from __future__ import annotations

import torch

from lowprec.linear.graph_sources import SHARED, At, Input, forward_source


def test_at_reads_the_memory_it_was_made_on_and_accepts_only_what_lies_there():
    x = torch.randn(6, 8)
    at = At(x)
    assert at.buffer.data_ptr() == x.data_ptr() and torch.equal(at.buffer, x)
    x.mul_(3)  # the view reads the memory, not a copy
    assert torch.equal(at.buffer, x)
    assert at.accepts(x) and not at.fill(x)
    assert not at.accepts(x.clone())                     # elsewhere
    assert not at.accepts(x.view(8, 6))                  # same place, other layout
    assert not at.accepts(x.view(torch.int32))           # same place, other dtype
    assert not at.accepts(x[1:])                         # other address


def test_at_does_not_keep_the_memory_alive():
    x = torch.randn(6, 8)
    before = torch._C._storage_Use_Count(x.untyped_storage()._cdata)
    at = At(x)
    assert torch._C._storage_Use_Count(x.untyped_storage()._cdata) == before
    assert at.buffer.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_at_covers_strided_and_offset_views():
    base = torch.randn(10, 12)
    x = base[2:, 1::2]
    at = At(x)
    assert torch.equal(at.buffer, x) and at.accepts(x)
    assert not at.accepts(base[2:, ::2])


def test_input_copies_a_tensor_once_per_version():
    x = torch.randn(4, 5)
    buf = Input(x)
    assert buf.accepts(torch.randn(7))  # any tensor: it is copied in
    assert buf.fill(x) and torch.equal(buf.buffer, x)
    assert not buf.fill(x)               # the same tensor, unchanged: no copy
    x.add_(1)
    assert buf.fill(x) and torch.equal(buf.buffer, x)
    y = x.clone()
    assert buf.fill(y) and torch.equal(buf.buffer, y)


def test_forward_source_where_or_the_shared_buffer_of_the_layout():
    x = torch.randn(3, 4)
    assert isinstance(forward_source(x, True), At)
    shared = forward_source(x, False)
    assert shared is SHARED.get(torch.empty(3, 4)) and shared.shared
    assert isinstance(forward_source(torch.empty(0, 4), True), Input)  # nothing to point at
