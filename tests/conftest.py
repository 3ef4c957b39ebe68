"""Suite-wide settings."""

import gc
import itertools

import pytest
import torch

# The suite is thousands of small tensor ops: on a 2-core CI machine intra-op threads cost
# more in synchronisation than they save (measured: ~3x faster with one thread).
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow: the GPU kernel fuzzers in "
                          "tests/slow/ and the exhaustive matrices the default run samples")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` are deselected unless ``--slow`` is given or ``-m`` names them."""
    if config.getoption("--slow") or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


#: tests a worker runs between two collections of all its objects (see young_collections):
#: each walks a million or more objects (a second or two); what they free in between is
#: some hundreds of MB a worker
FULL_COLLECTION_EVERY = 1000
_tests_run = itertools.count(1)


@pytest.fixture(autouse=True)
def young_collections():
    """The garbage collector's passes during a test walk only the objects made since it
    began. A worker's older objects (imported modules, compiled code and caches of earlier
    tests: a million objects after a few hundred compile tests) are frozen out of them:
    walking those took about half a second a full pass, tens of passes a worker (lowprec's
    convert_model collects once a call). What earlier tests left in reference cycles is
    freed by a full collection every ``FULL_COLLECTION_EVERY`` tests."""
    gc.freeze()
    yield
    gc.unfreeze()
    if next(_tests_run) % FULL_COLLECTION_EVERY == 0:
        gc.collect()


@pytest.fixture(autouse=True)
def compiled_first_steps():
    """Delayed scaling's first training step compiles as the test writes it: the eager first
    steps of a thread (``lowprec.recipe.first_step``) would fall on whichever tests of a
    worker enter a delayed region first. Their own tests take them (``eager_first_step``)."""
    from lowprec.recipe import first_step
    first_step._TAKEN.count = first_step.MAX_EAGER_REGIONS
    yield


@pytest.fixture
def eager_first_step():
    """The thread's eager first steps not yet taken (``lowprec.recipe.first_step``), and no
    earlier test's delayed-scaling state alive (a seeded one would count as a step taken)."""
    from lowprec.recipe import first_step
    gc.unfreeze()  # what young_collections froze holds the earlier tests' states
    gc.collect()
    gc.freeze()
    first_step._TAKEN.count = 0
    yield
    first_step._TAKEN.count = first_step.MAX_EAGER_REGIONS


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches emptied before and after the test (files of compiled tests use it
    through ``pytestmark``), so one test's compiled code and guards never serve another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_kernel_loads_in_capture():
    """Fails a test whose capture loaded a Triton kernel for the first time, naming it.

    CUDA does not allow loading a module during capture, and the capture then fails later
    with "operation failed due to a previous error during capture", which does not say
    which kernel's variant the warm-up missed (a pointer of another alignment, an integer
    equal to 1 or divisible by 16 in the capture only)."""
    from triton import knobs
    loaded = []

    def on_load(module, function, name, *rest):
        if torch.cuda.is_current_stream_capturing():
            loaded.append(name)
    knobs.runtime.kernel_load_start_hook.add(on_load)
    try:
        yield
    finally:
        knobs.runtime.kernel_load_start_hook.remove(on_load)
    assert not loaded, f"Triton kernels first loaded inside a CUDA graph capture: {loaded}"


@pytest.fixture
def columnwise_made(monkeypatch) -> list:
    """Every quantized tensor made holding columnwise data from now on, and every
    ``update_usage`` that adds that direction to a tensor (the inference-usage tests of
    modules and ops)."""
    from lowprec.formats.base import QuantizedTensor

    made = []
    new, update_usage = QuantizedTensor.__new__, QuantizedTensor.update_usage

    def spy_new(cls, shape, dtype, *, requires_grad=False, **fields):
        if any(name.startswith("columnwise_") and t is not None for name, t in fields.items()):
            made.append(f"{cls.__name__}{tuple(shape)}")
        return new(cls, shape, dtype, requires_grad=requires_grad, **fields)

    def spy_update_usage(self, rowwise_usage=None, columnwise_usage=None):
        if columnwise_usage and not self.has_usage("columnwise"):
            made.append(f"update_usage {type(self).__name__}{tuple(self.shape)}")
        return update_usage(self, rowwise_usage, columnwise_usage)

    monkeypatch.setattr(QuantizedTensor, "__new__", staticmethod(spy_new))
    monkeypatch.setattr(QuantizedTensor, "update_usage", spy_update_usage)
    return made
