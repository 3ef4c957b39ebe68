"""Compile machinery outside the traced linear: ``call`` runs a lowprec module's forward as
one opaque custom op (``lowprec::call``) where it cannot trace, with the handle, the amax
records and the logged fallback reasons it needs."""
