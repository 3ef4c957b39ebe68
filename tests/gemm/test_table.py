"""The GEMM table (lowprec/gemm/table.py): a route for every pair of operand kinds on every
device, and the same kinds (so the same routes) for eager tensors and traced forms."""

from __future__ import annotations

import itertools

import pytest
import torch

import lowprec
from lowprec.formats import Kind
from lowprec.gemm import (
    ROUTE_NAMES,
    ROUTES,
    GroupedDevice,
    grouped_route,
    route,
    select_route,
    use_backends,
)
from lowprec.gemm.table import CUTLASS_ROWS

E4, E5, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16

#: every kind a traced form gives (``formats/*/graph.py``)
KINDS = ([Kind("fp8", dt) for dt in (E4, E5)]
         + [Kind("blocks", dt, dim, pow2=p) for dt in (E4, E5) for dim in (1, 2)
            for p in (True, False)]
         + [Kind("exact", rht=r, divisor=d, bf16=b) for r in (False, True)
            for d in (False, True) for b in (False, True)]
         + [Kind("plain", dtype=dt) for dt in (BF16, torch.float16, torch.float32)])


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float16, torch.float32])
def test_every_pair_has_a_route(cuda, out_dtype):
    """Total: whatever two kinds meet, in whatever shape, the table names a route it runs
    (the fp32 emulation where no tensor-core route takes the pair)."""
    for a, b in itertools.product(KINDS, repeat=2):
        for m, n, k in ((256, 512, 512), (40, 24, 100)):
            for bias in (None, out_dtype, torch.float32):
                got = route(a, b, m, n, k, out_dtype, bias, cuda)
                assert got in ROUTES and got in ROUTE_NAMES, (a, b, m, n, k, bias, cuda, got)


def test_block_pairs_cublas_does_not_take_route_as_eager():
    """The traced GEMM table picks eager's backend for block FP8 pairs on CUDA: cuBLAS's
    block GEMM where it takes the pair, else (128x128 scales over K/128 not a multiple of 4,
    128x128 x 128x128, E5M2 x E5M2) the bf16 GEMM of the exact values, which power-of-two
    scales make exact; scales not known to be powers of two take the fp32 emulation, as
    eager does (its operands dequantized by eager's ops)."""
    e4, e5, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    x, w, dy = Kind("blocks", e4, 1), Kind("blocks", e4, 2), Kind("blocks", e5, 1)
    assert route(x, w, 256, 512, 512, bf16, None, True) == "cublas_fp8_block"
    assert route(x, w, 256, 512, 768, bf16, None, True) == "exact_bf16"  # 768 / 128 = 6
    assert route(w, w, 256, 512, 512, bf16, None, True) == "exact_bf16"
    assert route(dy, dy, 256, 512, 512, bf16, None, True) == "exact_bf16"
    assert route(dy, x, 256, 512, 512, bf16, None, True) == "cublas_fp8_block"
    assert route(x, Kind("fp8", e4), 256, 512, 512, bf16, None, True) == "exact_bf16"
    unknown = Kind("blocks", e4, 2, pow2=False)
    assert route(x, unknown, 256, 512, 768, bf16, None, True) == "emulated"
    assert route(x, w, 256, 512, 768, bf16, None, False) == "emulated"  # CPU




def test_plain_route_needs_the_output_dtype_everywhere():
    bf16 = Kind("plain", dtype=BF16)
    assert route(bf16, bf16, 64, 64, 64, BF16, BF16, False) == "plain"
    assert route(bf16, bf16, 64, 64, 64, BF16, torch.float32, False) == "emulated"
    assert route(bf16, bf16, 64, 64, 64, torch.float32, None, True) == "exact_bf16"
    assert route(bf16, bf16, 0, 64, 64, torch.float32, None, True) == "emulated"  # empty


def test_excluded_routes_fall_to_the_next():
    fp8 = Kind("fp8", E4)
    assert route(fp8, fp8, 64, 64, 64, BF16, None, True) == "cublas_fp8"
    assert route(fp8, fp8, 64, 64, 64, BF16, None, True, frozenset({"cublas_fp8"})) \
        == "exact_bf16"
    assert route(fp8, fp8, 64, 64, 64, BF16, None, True,
                 frozenset({"cublas_fp8", "exact_bf16"})) == "emulated"


QUANTIZERS = {
    "e4m3": lambda: lowprec.Float8CurrentScalingQuantizer(E4),
    "e5m2": lambda: lowprec.Float8CurrentScalingQuantizer(E5),
    "block1": lambda: lowprec.Float8BlockQuantizer(E4, block_scaling_dim=1),
    "block2": lambda: lowprec.Float8BlockQuantizer(E4, block_scaling_dim=2),
    "block_not_pow2": lambda: lowprec.Float8BlockQuantizer(E4, force_pow_2_scales=False),
    "mxfp8": lambda: lowprec.MXFP8Quantizer(),
    "nvfp4": lambda: lowprec.NVFP4Quantizer(),
    "nvfp4_rht": lambda: lowprec.NVFP4Quantizer(with_rht=True),
    "identity": lambda: lowprec.IdentityQuantizer(BF16),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_eager_tensors_have_their_traced_forms_kinds(name, device):
    """What an eager quantized tensor tells the table is what its quantizer's traced form
    tells it, per usage: one kind, so one route, in both forms."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q = QUANTIZERS[name]()
    t = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).to(device, BF16)
    q.set_usage(rowwise=True, columnwise=True)
    qt = q.quantize(t)
    form = q.graph_operand(t)
    assert not isinstance(form, str), form
    for usage in ("rowwise", "columnwise"):
        assert qt.gemm_kind(usage) == form.kind(usage), usage


def test_eager_dispatch_takes_the_tables_route_on_cudas_routes():
    """Eager's dispatcher asks the table (here on CUDA's routes, on the CPU) for every
    pair of these tensors; unaligned data leaves cuBLAS for the next route."""
    from lowprec.gemm import cuda_routes
    from lowprec.gemm.dispatch import _kind
    gen = torch.Generator().manual_seed(1)
    made = {n: QUANTIZERS[n]().quantize(torch.randn(128, 256, generator=gen).to(BF16))
            for n in ("e4m3", "e5m2", "block1", "block2", "mxfp8", "identity")}
    made["bf16"] = torch.randn(128, 256, generator=gen).to(BF16)
    with cuda_routes():
        for (na, a), (nb, b) in itertools.product(made.items(), repeat=2):
            want = route(_kind(a, "rowwise", True), _kind(b, "rowwise", True), 128, 128, 256,
                         BF16, None, True)
            assert select_route(a, "rowwise", b, "rowwise", BF16) == want, (na, nb)
        with use_backends(("plain", "emulated")):
            assert select_route(made["e4m3"], "rowwise", made["e4m3"], "rowwise", BF16) \
                == "emulated"
        x = torch.randn(128, 257, generator=gen).to(BF16)[:, 1:]  # not 16-byte aligned
        xq = QUANTIZERS["e4m3"]().quantize(x)
        assert select_route(xq, "rowwise", made["e4m3"], "rowwise", BF16) == "cublas_fp8"
        unaligned = xq.rowwise_data.new_empty(128 * 256 + 1)[1:].view(128, 256)
        unaligned.copy_(xq.rowwise_data)
        xq.rowwise_data = unaligned
        assert select_route(xq, "rowwise", made["e4m3"], "rowwise", BF16) == "exact_bf16"


def test_use_backends_names_routes():
    with pytest.raises(ValueError, match="emulated"):
        with use_backends(("plain",)):
            pass
    with pytest.raises(ValueError, match="emulated_fp32"):
        with use_backends(("plain", "emulated_fp32")):
            pass


HOPPER = GroupedDevice(hopper=True, triton=True, grouped_mm=True, scaled_grouped_mm=True)


def test_grouped_routes_as_a_gpu_takes_them():
    """The grouped (MoE) GEMMs' routes from the scheme, shapes and a device described by
    hand: what a Hopper GPU with Triton runs, and every call one GEMM a group elsewhere."""
    def r(scheme, dtypes=(), rows=4096, n=256, k=512, groups=4, device=HOPPER, dt=BF16):
        return grouped_route(scheme, dt, dtypes, rows, n, k, groups, device)
    assert r("plain") == r("exact") == "grouped_mm"
    assert r("plain", k=510) == r("plain", dt=torch.float32) == "per_group"
    assert r("current", (E4, E4), rows=CUTLASS_ROWS * 4) == "scaled_grouped_mm"
    assert r("current", (E4, E4), rows=CUTLASS_ROWS * 4 - 16) == "fp8_grouped"
    assert r("current", (E5, E4), rows=CUTLASS_ROWS * 4) == "fp8_grouped"  # E5M2 dY
    assert r("current", (E5, E5)) == "per_group"
    assert r("current", (E4, E4), n=40) == r("current", (E4, E4), dt=torch.float16) \
        == "per_group"
    no_triton = GroupedDevice(hopper=True, grouped_mm=True, scaled_grouped_mm=True)
    assert r("current", (E4, E4), rows=16, device=no_triton) == "scaled_grouped_mm"
    assert r("current", (E5, E4), device=no_triton) == "per_group"
    assert r("block", (E4, E4, E4)) == "block_grouped"
    assert r("block", (E4, E4, E5)) == r("block", (E4,) * 3, device=no_triton) == "per_group"
    assert r("nvfp4") == "fp8_grouped"
    assert r("nvfp4", device=no_triton) == "per_group"
    for scheme in ("plain", "exact", "current", "block", "nvfp4"):
        assert r(scheme, (E4, E4, E4), device=GroupedDevice()) == "per_group"
    with pytest.raises(ValueError, match="unknown scheme 'mxfp8'"):
        r("mxfp8")


def test_grouped_device_of_a_cpu_tensor_offers_nothing_grouped():
    from lowprec.gemm import grouped_device
    got = grouped_device(torch.empty(1))
    assert not (got.hopper or got.triton)
