"""``lowprec compare``: one model trained once per recipe, reported side by side.

Run ``lowprec compare --help`` (or ``python -m lowprec compare --help``). The model is a
preset GPT, a Hugging Face model directory or the user's own ``build()``; the data the
standard library's source or the user's text or token ids. The pieces are importable for
scripting: :mod:`.model` (the GPT and its presets), :mod:`.user_model` (``--model``),
:mod:`.data` (``--data``), :mod:`.recipes` (named recipes, ``--recipe-file``),
:mod:`.train` (one run), :mod:`.resume` (checkpoints, atomic writes), :mod:`.probe`
(SQNR and saved-tensor measurements), :mod:`.stability` (spikes, divergence) and
:mod:`.report` (the output files and verdicts); :mod:`.make_llama` (``lowprec make-llama``)
writes a Llama config and tokenizer for ``--model``. matplotlib is needed only for the
plots.
"""

from .cli import main

__all__ = ["main"]

# The rest of lowprec enters the package here (internal names, not in __all__).
