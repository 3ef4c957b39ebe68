"""``lowprec.kernels.launch.BoundCalls`` on any machine: its bookkeeping with a stand-in
kernel whose launches are recorded (the GPU test ``tests/kernels/test_kernel_launch_gpu.py`` runs
real Triton kernels). The first call of a kind launches through ``launch``, the second
binds, later calls put their tensors in their places, positional or named; fallbacks go
through ``launch`` without binding."""

from __future__ import annotations

import torch

from lowprec.kernels import launch as launch_mod


class _Kernel:
    """A stand-in kernel: the names of its parameters, in order."""

    arg_names = ["x_ptr", "n", "y_ptr", "scale", "BLOCK"]


class _Compiled:
    """What binding finds compiled: ``run`` records the tensors each launch passes."""

    function = packed_metadata = None
    runs: list = []

    @classmethod
    def run(cls, gx, gy, gz, stream, function, metadata, launch_md, enter, exit_, *values):
        cls.runs.append(values)


def _setup(monkeypatch):
    launched, bound = [], []
    _Compiled.runs = []
    monkeypatch.setattr(launch_mod, "launch",
                        lambda kernel, grid, *args, **kwargs: launched.append((args, kwargs)))
    monkeypatch.setattr(launch_mod, "fast_launches", lambda: True)

    def bound_values(kernel, grid, args, kwargs):
        bound.append(1)
        values = list(args) + [kwargs.get(name) for name in kernel.arg_names[len(args):]]
        return _Compiled, values, 0
    monkeypatch.setattr(launch_mod, "_bound_values", bound_values)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    return launched, bound


def _calls(x, y):
    return lambda: [(_Kernel, (4,), (x, 8), dict(y_ptr=y, scale=2.0, BLOCK=16))]


def test_first_call_launches_second_binds_then_places(monkeypatch):
    launched, bound = _setup(monkeypatch)
    calls = launch_mod.BoundCalls()
    tensors = [(torch.zeros(8), torch.zeros(8)) for _ in range(4)]
    for x, y in tensors:
        calls.run("kind", (y, None, x), _calls(x, y))
    assert len(launched) == 1 and len(bound) == 1  # launched, then bound once
    # the binding call and the next two ran bound, each with its own tensors in place
    assert len(_Compiled.runs) == 3
    for values, (x, y) in zip(_Compiled.runs, tensors[1:]):
        assert values[0] is x and values[2] is y and values[1] == 8 and values[3] == 2.0


def test_fallbacks_launch_without_binding(monkeypatch):
    launched, bound = _setup(monkeypatch)
    calls = launch_mod.BoundCalls()
    base = torch.zeros(64)
    x, y = torch.zeros(8), torch.zeros(8)
    calls.run("kind", (x, y), _calls(x, y))
    calls.run("kind", (x, y), _calls(x, y))  # binds
    off = base[1:9]  # not 16-byte aligned: Triton would specialize differently
    calls.run("kind", (off, y), _calls(off, y))
    with launch_mod.unbound_calls():
        calls.run("kind", (x, y), _calls(x, y))
    calls.run("other", (x, y), _calls(x, y))  # a new kind starts over
    assert len(launched) == 4 and len(bound) == 1 and len(_Compiled.runs) == 1


def test_an_unaligned_first_call_does_not_count_as_the_kinds_first(monkeypatch):
    """Binding reads the compiled kernel of the specialization the kind's first launch ran;
    an unaligned tensor's launch compiles another one, so it leaves the kind unseen."""
    launched, bound = _setup(monkeypatch)
    calls = launch_mod.BoundCalls()
    off, x, y = torch.zeros(64)[1:9], torch.zeros(8), torch.zeros(8)
    calls.run("kind", (off, y), _calls(off, y))
    assert "kind" not in calls._kinds
    calls.run("kind", (x, y), _calls(x, y))  # the kind's first call
    calls.run("kind", (x, y), _calls(x, y))  # binds
    assert len(launched) == 2 and len(bound) == 1 and len(_Compiled.runs) == 1


def test_a_kind_whose_launch_does_not_bind_keeps_launching(monkeypatch):
    launched, bound = _setup(monkeypatch)
    monkeypatch.setattr(launch_mod, "_bound_values", lambda *a: bound.append(1))
    calls = launch_mod.BoundCalls()
    x, y = torch.zeros(8), torch.zeros(8)
    for _ in range(4):
        calls.run("kind", (x, y), _calls(x, y))
    assert len(launched) == 4 and len(bound) == 1  # tried once, then never again


def test_a_tensor_argument_outside_the_calls_tensors_is_not_bound(monkeypatch):
    launched, bound = _setup(monkeypatch)
    calls = launch_mod.BoundCalls()
    x, other = torch.zeros(8), torch.zeros(8)
    for _ in range(3):  # ``other`` is passed to the kernel but not named among the tensors
        calls.run("kind", (x,), lambda: [(_Kernel, (4,), (x, 8), dict(y_ptr=other))])
    assert len(launched) == 3 and not bound and not _Compiled.runs


def test_placed_launch_holds_none_of_the_binding_calls_tensors():
    x, y = torch.zeros(8), torch.zeros(8)
    placed = launch_mod.PlacedLaunch(_Compiled, (4,), [x, 8, y, 2.0, 16], ((0, 0), (2, 1)), 0)
    assert all(not isinstance(v, torch.Tensor) for v in placed._values)
