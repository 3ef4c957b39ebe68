"""Any shape quantizes (SPEC §2): a dimension that is not a whole number of blocks ends in
a partial block (or tile) whose scale comes from the values it holds, and a 0-d tensor is
one scaling unit. The result is, bit for bit, the tensor zero-padded to whole blocks and
cut back: zeros change no block amax (nor NVFP4's global one). On CUDA the quantize
kernels run on the padded matrix, so the kernels and the reference agree on partial blocks
as they do on whole ones (checked here on the device where there is one)."""

from __future__ import annotations

import pytest
import torch

from lowprec import HybridQuantizer
from lowprec.formats.block import Float8BlockQuantizer
from lowprec.formats.mxfp8 import MXFP8Quantizer
from lowprec.formats.nvfp4 import NVFP4Quantizer
from lowprec.gemm.dispatch import gemm
from lowprec.kernels import triton_available

E4M3 = torch.float8_e4m3fn
USAGES = ("rowwise", "columnwise")

QUANTIZERS = {
    "block1": lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1),
    "block2": lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=2),
    "mxfp8": lambda: MXFP8Quantizer(),
    "mxfp8_2d": lambda: MXFP8Quantizer(with_2d_quantization=True),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_sr": lambda: NVFP4Quantizer(stochastic_rounding=True),
    "nvfp4_rht_rowwise": lambda: NVFP4Quantizer(with_rht=True).set_usage(columnwise=False),
    "hybrid": lambda: HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(),
                                      columnwise_quantizer=NVFP4Quantizer()),
}
#: shapes with partial blocks in M, K or both, a 1-D and a 0-d tensor
SHAPES = [(), (5,), (33, 70), (3, 5, 41), (130, 200), (128, 129)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and triton_available() else [])


def _padded_reference(name: str, x: torch.Tensor, usage: str, seed: int) -> torch.Tensor:
    """``usage``'s values of ``x`` zero-padded to whole blocks by hand, quantized, cut back.
    Padded to a multiple of every block edge (128, 32, 16), except under stochastic
    rounding, whose draws follow the padded size: there to the quantizer's own blocks."""
    m, k = (x.numel() // x.shape[-1], x.shape[-1]) if x.dim() else (1, 1)
    q = QUANTIZERS[name]()
    rows, cols = 256, 256
    if "sr" in name:
        rows = q.row_multiple(rowwise=q.rowwise_usage, columnwise=q.columnwise_usage)
        cols = q.col_multiple(rowwise=q.rowwise_usage, columnwise=q.columnwise_usage)
    padded = x.new_zeros(-(-m // rows) * rows, -(-k // cols) * cols)
    padded[:m, :k] = x.reshape(m, k)
    torch.manual_seed(seed)
    if usage == "columnwise" and not q.columnwise_usage:
        return None
    return q.quantize(padded).dequantize(usage=usage)[:m, :k].reshape(x.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_partial_blocks_are_the_zero_padded_tensor_cut_back(name, shape, device):
    gen = torch.Generator().manual_seed(len(shape) * 7 + sum(shape))
    x = (torch.randn(shape, generator=gen) * 4).to(device=device, dtype=torch.bfloat16)
    torch.manual_seed(11)  # stochastic rounding draws for the padded matrix, the same here
    qt = QUANTIZERS[name]().quantize(x)
    assert qt.shape == x.shape and qt.dtype == x.dtype
    for usage in USAGES:
        want = _padded_reference(name, x, usage, 11)
        if want is None:
            assert not qt.has_usage(usage)
            continue
        assert torch.equal(qt.dequantize(usage=usage), want), usage
    if "sr" not in name:  # the kernels' bits are the reference's on partial blocks too
        torch.manual_seed(11)
        cpu = QUANTIZERS[name]().quantize(x.cpu())
        for usage in USAGES:
            if qt.has_usage(usage):
                assert torch.equal(qt.dequantize(usage=usage).cpu(),
                                   cpu.dequantize(usage=usage)), usage


@pytest.mark.parametrize("name", ["block1", "block2", "mxfp8", "mxfp8_2d", "nvfp4", "nvfp4_2d"])
def test_stored_sizes_are_the_tensors_own(name):
    """Data keeps the tensor's size ((M, K) rowwise, (K, M) columnwise; NVFP4 two codes a
    byte), scales one a block, the partial ones included."""
    q = QUANTIZERS[name]()
    qt = q.quantize(torch.randn(3, 11, 70))
    m, k = 33, 70
    for usage, (rows, cols) in (("rowwise", (m, k)), ("columnwise", (k, m))):
        br, bc = qt._stored_block(usage)
        data, scale = getattr(qt, f"{usage}_data"), getattr(qt, f"{usage}_scale")
        assert tuple(data.shape) == (rows, -(-cols // qt._packing))
        assert tuple(scale.shape) == (-(-rows // br), -(-cols // bc))
        assert qt.partial(usage)
    empty = q.make_empty((3, 11, 70))
    for name_, t in qt.inner_tensors().items():
        other = getattr(empty, name_)
        assert (t is None) == (other is None) and (t is None or t.shape == other.shape), name_


def test_a_partial_block_scales_by_its_own_values():
    """The last 1x128 block of a row holds small values only: its own scale keeps them
    exact to FP8's precision, where one shared with the big values would flush them."""
    x = torch.full((4, 130), 1000.0)
    x[:, 128:] = 1e-3
    qt = Float8BlockQuantizer(E4M3, block_scaling_dim=1).set_usage(columnwise=False).quantize(x)
    assert qt.rowwise_scale.shape == (4, 2)
    out = qt.dequantize()
    assert torch.allclose(out[:, 128:], x[:, 128:], rtol=2 ** -3)


@pytest.mark.parametrize("name", ["block1", "mxfp8", "nvfp4", "hybrid"])
def test_partial_operands_multiply_as_their_dequantized_values(name):
    """A GEMM of operands ending in partial blocks is the fp32 product of their values."""
    q = QUANTIZERS[name]()
    a, b = q.quantize(torch.randn(33, 70)), q.quantize(torch.randn(20, 70))
    got = gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32)
    want = a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()
    assert torch.equal(got, want)
    c = q.quantize(torch.randn(33, 20))  # wgrad's pair: the contraction runs along M = 33
    got = gemm(a, "columnwise", c, "columnwise", out_dtype=torch.float32)
    want = (a.dequantize(torch.float32, usage="columnwise").t()
            @ c.dequantize(torch.float32, usage="columnwise"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["block2", "mxfp8_2d"])
def test_2d_tiles_derive_the_other_direction_with_partial_tiles(name):
    q = QUANTIZERS[name]().set_usage(rowwise=True, columnwise=False)
    x = torch.randn(40, 150)
    qt = q.quantize(x)
    qt.update_usage(columnwise_usage=True)
    both = QUANTIZERS[name]().quantize(x)
    assert torch.equal(qt.dequantize(usage="columnwise"), both.dequantize(usage="columnwise"))


@pytest.mark.parametrize("name", ["block1", "mxfp8", "nvfp4"])
def test_partial_tensors_view_copy_and_update(name):
    q = QUANTIZERS[name]()
    x, y = torch.randn(2, 5, 70), torch.randn(2, 5, 70)
    qt = q.quantize(x)
    assert torch.equal(qt.view(10, 70).dequantize(), qt.dequantize().view(10, 70))
    assert torch.equal(qt.reshape(-1, 70).dequantize(usage="columnwise"),
                       qt.dequantize(usage="columnwise").reshape(10, 70))
    chunks = torch.chunk(qt, 2)  # outside the table: the dequantized values' chunks
    assert all(torch.equal(c, d) for c, d in zip(chunks, torch.chunk(qt.dequantize(), 2)))
    other = q.quantize(y)
    qt.copy_(other)
    assert torch.equal(qt.dequantize(), other.dequantize())
    q.update_quantized(x, qt)
    assert torch.equal(qt.dequantize(), q.quantize(x).dequantize())


def test_the_rht_refuses_partial_tiles_along_its_transform():
    """The transform mixes a tile's 16 values: a zero-padded partial tile along M would
    spread the padding into the stored codes, so the columnwise (RHT) data needs whole
    16-row tiles, with a clear error; the rowwise data takes any shape."""
    with pytest.raises(ValueError, match=r"RHT.*\(33, 64\).*M=33"):
        NVFP4Quantizer(with_rht=True).quantize(torch.randn(33, 64))
    qt = NVFP4Quantizer(with_rht=True).quantize(torch.randn(32, 70))  # K partial: fine
    assert qt.partial("rowwise")
