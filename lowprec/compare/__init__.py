"""``lowprec compare``: the same small GPT trained once per recipe, reported side by side.

Run ``lowprec compare --help`` (or ``python -m lowprec compare --help``). The pieces
are importable for scripting: :mod:`.model` (the GPT and its presets), :mod:`.data`
(the standard-library corpus), :mod:`.recipes` (named recipes, ``--recipe-file``),
:mod:`.train` (one run), :mod:`.probe` (SQNR and saved-tensor measurements) and
:mod:`.report` (the output files). matplotlib is needed only for loss.png.
"""

from .cli import main

__all__ = ["main"]
