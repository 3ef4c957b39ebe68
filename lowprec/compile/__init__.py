"""Compile machinery outside the traced linear: ``call`` runs a lowprec module's forward as
one opaque custom op (``lowprec::call``) where it cannot trace, with the handle, the amax
records and the logged fallback reasons it needs."""

# The rest of lowprec enters the package here (internal names, not in __all__).
from .call import (
    HANDLE_ATTR,
    CompiledCallMixin,
    ExpertsStandIn,
    compiled_as_one_op,
    opaque_call,
    opaque_refusal,
)
