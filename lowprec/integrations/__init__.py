"""Adapters for training frameworks that build the model themselves.

Each submodule imports its framework and is imported only by the user (for instance by
the framework's own custom-import option): ``import lowprec`` never imports them.

* :mod:`lowprec.integrations.torchtitan`: torchtitan 0.3's config module, trainer and
  model-config converter for lowprec recipes.
"""
